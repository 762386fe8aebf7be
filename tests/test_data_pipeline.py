"""fe-data on the bundled corpus, and every bad-input case naming file and line."""

import json

import numpy
import pytest

from fe_megatron.data.cli import main as fe_data
from fe_megatron.data.sources import DataError, iter_documents, validate_inputs
from tests.helpers.paths import CORPUS



def test_bundled_corpus_is_readable_and_not_eval_data():
    docs = list(iter_documents([CORPUS]))
    assert len(docs) == 233 and all(len(d) > 1000 for d in docs)


def test_preprocess_roundtrip(small_data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from fe_megatron.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(small_data["tokenizer"])
    dataset = IndexedDataset(small_data["prefix"])
    assert len(dataset) == 40
    first_text = next(iter_documents([small_data["subset"]]))
    first = numpy.asarray(dataset[0])
    assert first[-1] == tok.eod and first[:-1].tolist() == tok.tokenize(first_text).tolist()
    assert tok.detokenize(first[:50]) in first_text


def test_preprocess_reports_counts(small_data, tmp_path, capsys):
    assert fe_data(["preprocess", "--input", small_data["subset"], "--tokenizer-model", small_data["tokenizer"],
                    "--output-prefix", str(tmp_path / "again"), "--no-progress"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["documents"] == 40 and stats["tokens"] > 100_000 and stats["tokens_per_second"] > 0


def test_txt_and_parquet_inputs(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("first document\n\nsecond document\n")
    assert list(iter_documents([str(txt)])) == ["first document", "second document"]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    pq.write_table(pyarrow.table({"text": ["x y", "z"]}), tmp_path / "b.parquet")
    assert list(iter_documents([str(tmp_path / "b.parquet")])) == ["x y", "z"]


@pytest.mark.parametrize("content, fragment", [
    ('{"text": "ok"}\n{"text": "broken"\n', r"bad.jsonl:2: malformed JSON"),
    ('{"text": "ok"}\n\n{"body": "no text"}\n', r"bad.jsonl:3: no 'text' field \(found: \['body'\]\)"),
    ('{"text": 5}\n', r"bad.jsonl:1: field 'text' is a int, expected a string"),
    ('\n\n', r"empty corpus"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=fragment):
        validate_inputs([str(path)], "text")


def test_bad_input_fails_before_writing(tmp_path, small_data, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    rc = fe_data(["preprocess", "--input", str(bad), "--tokenizer-model", small_data["tokenizer"],
                  "--output-prefix", str(tmp_path / "out"), "--no-progress"])
    assert rc == 2 and "bad.jsonl:2: malformed JSON" in capsys.readouterr().err
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())
    assert fe_data(["preprocess", "--input", str(tmp_path / "missing.jsonl"), "--tokenizer-model",
                    small_data["tokenizer"], "--output-prefix", str(tmp_path / "o")]) == 2
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="x.csv: unknown format"):
        validate_inputs([str(tmp_path / "x.csv")], "text")


def write_indexed_dataset(prefix, token_ids, dtype_code=8):
    """A Megatron indexed dataset as check_token_ids_fit reads it: the .idx header (the dtype's
    code: 8 = uint16, 4 = int32) and the .bin's flat token ids."""
    import struct

    from fe_megatron.data.vocab_check import INDEX_DTYPES, INDEX_HEADER

    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(INDEX_HEADER + struct.pack("<QB", 1, dtype_code))
    numpy.asarray(token_ids, dtype=INDEX_DTYPES[dtype_code]).tofile(f"{prefix}.bin")


def test_data_made_with_another_tokenizer_is_refused_naming_both_files(small_data, tmp_path):
    from fe_megatron.data.vocab_check import check_token_ids_fit

    largest = int(numpy.fromfile(small_data["prefix"] + ".bin", dtype=numpy.uint16).max())
    assert 256 <= largest < 512
    check_token_ids_fit([small_data["prefix"]], 512, small_data["tokenizer"])  # the tokenizer it was made with
    with pytest.raises(DataError) as info:
        check_token_ids_fit([small_data["prefix"]], 4096, "other/tok.model", tokenizer_size=256)
    assert str(info.value) == (
        f"{small_data['prefix']}.bin holds token id {largest} (its largest; every token read), but the tokenizer "
        f"other/tok.model has 256 pieces (ids 0 to 255): the data was made with another, larger tokenizer. Re-run "
        f"`fe-data preprocess --tokenizer-model other/tok.model` on the data's text, or set data.tokenizer_model to "
        f"the tokenizer the data was made with (model.vocab_size=4096 must cover its pieces)")
    with pytest.raises(DataError, match=rf"corpus.bin holds token id {largest} \(its largest; every token read\), "
                                        rf"outside the model's vocabulary \[0, 300\) \(--vocab-size=300\); set "
                                        rf"--vocab-size to at least {largest + 1}"):
        check_token_ids_fit([small_data["prefix"]], 300, None, vocab_setting="--vocab-size")


def test_a_large_dataset_is_sampled_in_fixed_windows_and_the_message_says_so(tmp_path, monkeypatch):
    from fe_megatron.data import vocab_check

    monkeypatch.setattr(vocab_check, "FULL_SCAN_BYTES", 1000)
    ids = numpy.zeros(2**20, dtype=numpy.int64)  # 4 MiB of int32, 4 windows' worth
    ids[-1] = 70_000  # the last window ends with the file
    write_indexed_dataset(tmp_path / "big", ids, dtype_code=4)
    with pytest.raises(DataError, match=r"big.bin holds token id 70000 \(its largest; read in 256 evenly spaced "
                                        r"windows of 1 MiB of its 4 MiB\), but the tokenizer t.model has 32000"):
        vocab_check.check_token_ids_fit([str(tmp_path / "big")], 32000, "t.model", tokenizer_size=32000)
    write_indexed_dataset(tmp_path / "negative", [5, -1, 7], dtype_code=4)
    with pytest.raises(DataError, match=r"negative.bin holds token id -1 \(its smallest; every token read\): token "
                                        r"ids are never negative"):
        vocab_check.check_token_ids_fit([str(tmp_path / "negative")], 32000, None)
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"bad.idx is not a Megatron indexed dataset's index"):
        vocab_check.check_token_ids_fit([str(tmp_path / "bad")], 32000, None)
