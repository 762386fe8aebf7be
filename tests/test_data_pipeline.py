"""fe-data on the bundled corpus, and every bad-input case naming file and line."""

import json
import os

import numpy
import pytest

from fe_megatron.data.cli import main as fe_data
from fe_megatron.data.sources import DataError, iter_documents, validate_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "sotu.jsonl.gz")


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
