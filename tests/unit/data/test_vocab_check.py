"""`fe_megatron.data.vocab_check`: data made with another tokenizer is refused naming both files, and a
large dataset is read in fixed windows that the message names."""

import numpy
import pytest

from fe_megatron.data.sources import DataError


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
