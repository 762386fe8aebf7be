"""Read documents from txt / jsonl / jsonl.gz / parquet files or a Hugging Face dataset.

Bad input fails before any output is written, naming the file and line: bytes that are
not UTF-8, a malformed JSON line, a line without the text field, a non-string text, text
that is not valid Unicode (an unpaired surrogate escaped in JSON), an empty corpus.
Documents that are empty or only whitespace are skipped in every format.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Iterator, List


class DataError(ValueError):
    """A problem with the input data, naming where it is."""


def _lines(path: str) -> Iterator[tuple]:
    """``(line number, text)`` of each line, decoded as UTF-8 one line at a time, so that bytes
    that are not UTF-8 are reported with their line."""
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as fh:
        for line_no, raw in enumerate(fh, 1):
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                f"{err.start + 1}); re-encode the file as UTF-8") from None


def iter_json_records(path: str) -> Iterator[tuple]:
    """``(line number, parsed value)`` of each non-blank line of a JSON-lines file."""
    for line_no, line in _lines(path):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{line_no}: malformed JSON ({err.msg} at column {err.colno})") from None


def iter_jsonl(path: str, text_key: str) -> Iterator[str]:
    for line_no, record in iter_json_records(path):
        if not isinstance(record, dict) or text_key not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{line_no}: no '{text_key}' field (found: {keys}); "
                            "choose the field with --text-key")
        text = record[text_key]
        if not isinstance(text, str):
            raise DataError(f"{path}:{line_no}: field '{text_key}' is a {type(text).__name__}, expected a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataError(f"{path}:{line_no}: field '{text_key}' holds an unpaired surrogate "
                            f"(\\u{ord(text[err.start]):04x} at character {err.start}), which is not valid "
                            "Unicode text") from None
        if text.strip():
            yield text


def iter_txt(path: str) -> Iterator[str]:
    """A .txt file holds one document per line."""
    for _, line in _lines(path):
        if line.strip():
            yield line.rstrip("\r\n")


def iter_parquet(path: str, text_key: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    if text_key not in table.schema.names:
        raise DataError(f"{path}: no '{text_key}' column (columns: {table.schema.names})")
    for batch in table.iter_batches(columns=[text_key]):
        for text in batch.column(0).to_pylist():
            if text and text.strip():
                yield text


def require_datasets_package():
    """``datasets.load_dataset``, or a DataError that says how to install it."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise DataError("reading hf:NAME inputs needs the Hugging Face 'datasets' package, which is not "
                        "installed; install it with: pip install 'fe_megatron[hf]' (or: pip install datasets)") from None
    return load_dataset


def iter_hf_dataset(name: str, text_key: str, split: str = "train", subset: str = None) -> Iterator[str]:
    load_dataset = require_datasets_package()

    for record in load_dataset(name, subset, split=split, streaming=True):
        if text_key not in record:
            raise DataError(f"dataset {name}: records have no '{text_key}' field (fields: {sorted(record)})")
        yield record[text_key]


def iter_documents(inputs: List[str], text_key: str = "text", hf_split: str = "train") -> Iterator[str]:
    """Documents from every input in order; ``hf:NAME[:SUBSET]`` names a Hugging Face dataset (streamed)."""
    for source in inputs:
        if source.startswith("hf:"):
            parts = source[3:].split(":")
            yield from iter_hf_dataset(parts[0], text_key, hf_split, parts[1] if len(parts) > 1 else None)
            continue
        if not os.path.isfile(source):
            raise DataError(f"{source}: no such file")
        if source.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".json")):
            yield from iter_jsonl(source, text_key)
        elif source.endswith((".txt", ".txt.gz")):
            yield from iter_txt(source)
        elif source.endswith(".parquet"):
            yield from iter_parquet(source, text_key)
        else:
            raise DataError(f"{source}: unknown format; expected .txt, .jsonl, .jsonl.gz or .parquet "
                            "(or hf:DATASET_NAME)")


def validate_inputs(inputs: List[str], text_key: str) -> int:
    """Read local files once, fully, and check that hf: inputs can be read, so bad input fails before
    anything is written. Returns the local document count."""
    if any(s.startswith("hf:") for s in inputs):
        require_datasets_package()
    count = 0
    for _ in iter_documents([s for s in inputs if not s.startswith("hf:")], text_key):
        count += 1
    if count == 0 and not any(s.startswith("hf:") for s in inputs):
        raise DataError(f"empty corpus: no documents in {', '.join(inputs)}")
    return count
