"""Whether a dataset's token ids fit the run's tokenizer and the model's vocabulary, checked
before training starts.

Data preprocessed with one tokenizer and trained with another, smaller one would otherwise start
and fail only at the first forward, on a token id outside the embedding, with nothing saying
that the data and the tokenizer do not belong together.  `check_token_ids_fit` reads each
Megatron indexed dataset's ``PREFIX.bin`` (a flat array of the dtype its ``PREFIX.idx`` header
names) through ``numpy.memmap``: a file of up to ``FULL_SCAN_BYTES`` whole, a larger one in
``SAMPLE_WINDOWS`` evenly spaced windows of ``WINDOW_BYTES`` (the same windows every time).  A
sample finds data made with a larger tokenizer, whose large ids are everywhere; it may miss a
single stray id.

Only numpy here (and the project's tokenizer loader when the piece count is not given), so that
every trainer can call it before its process groups: fe-pretrain, and Megatron-LM's trainer for
``--data-path``.
"""

from __future__ import annotations

import os
import struct
from typing import Optional, Sequence

import numpy

from fe_megatron.data.sources import DataError

# Megatron's indexed dataset (megatron.core.datasets.indexed_dataset): the .idx file starts with
# this header, a version (little-endian uint64, 1) and one byte naming the .bin's dtype.
INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64, 8: numpy.uint16}
FULL_SCAN_BYTES = 256 * 2**20  # a .bin up to this size is read whole
SAMPLE_WINDOWS = 256  # a larger one: this many windows, evenly spaced, the first and the last included
WINDOW_BYTES = 2**20
CHUNK_TOKENS = 2**24  # a whole file is reduced in chunks of this many tokens


def check_token_ids_fit(prefixes: Sequence[str], vocab_size: int, tokenizer_model: Optional[str],
                        tokenizer_size: Optional[int] = None, *, tokenizer_setting: str = "data.tokenizer_model",
                        vocab_setting: str = "model.vocab_size") -> None:
    """Raise `DataError` unless every token id in the indexed datasets ``prefixes`` (``PREFIX.bin``
    and ``PREFIX.idx``) lies below the tokenizer's piece count and the model's ``vocab_size``.

    ``tokenizer_model``: the tokenizer's file or directory, named in the message (None: the
    vocabulary alone is checked); ``tokenizer_size``: its piece count, read from
    ``tokenizer_model`` when not given.  ``tokenizer_setting`` and ``vocab_setting``: the names of
    the settings the message tells the user to change (fe-pretrain's by default; Megatron-LM's
    trainer passes ``--tokenizer-model`` and ``--vocab-size``)."""
    if tokenizer_model is not None and tokenizer_size is None:
        from fe_megatron.data.tokenizer import load_tokenizer

        tokenizer_size = load_tokenizer(tokenizer_model).vocab_size
    for prefix in prefixes:
        bin_path = f"{prefix}.bin"
        if not os.path.isfile(bin_path):
            raise DataError(f"{bin_path} does not exist (the dataset prefix {prefix} names {prefix}.bin and "
                            f"{prefix}.idx); create it with fe-data preprocess")
        dtype = index_dtype(f"{prefix}.idx")
        found = token_id_range(bin_path, dtype)
        if found is None:  # no tokens
            continue
        smallest, largest, how = found
        if smallest < 0:
            raise DataError(f"{bin_path} holds token id {smallest} (its smallest; {how}): token ids are never "
                            "negative, so this is not tokenized text; re-run fe-data preprocess on the text")
        if tokenizer_size is not None and largest >= tokenizer_size:
            raise DataError(
                f"{bin_path} holds token id {largest} (its largest; {how}), but the tokenizer {tokenizer_model} "
                f"has {tokenizer_size} pieces (ids 0 to {tokenizer_size - 1}): the data was made with another, "
                f"larger tokenizer. Re-run `fe-data preprocess --tokenizer-model {tokenizer_model}` on the data's "
                f"text, or set {tokenizer_setting} to the tokenizer the data was made with ({vocab_setting}="
                f"{vocab_size} must cover its pieces)")
        if largest >= vocab_size:
            raise DataError(
                f"{bin_path} holds token id {largest} (its largest; {how}), outside the model's vocabulary "
                f"[0, {vocab_size}) ({vocab_setting}={vocab_size}); set {vocab_setting} to at least {largest + 1}, "
                f"or preprocess the text with a tokenizer of at most {vocab_size} pieces")


def index_dtype(idx_path: str):
    """The numpy dtype of the token ids, from a Megatron ``.idx`` file's header."""
    if not os.path.isfile(idx_path):
        raise DataError(f"{idx_path} does not exist; create the dataset with fe-data preprocess")
    with open(idx_path, "rb") as fh:
        header = fh.read(len(INDEX_HEADER) + 9)
    if len(header) < len(INDEX_HEADER) + 9 or not header.startswith(INDEX_HEADER):
        raise DataError(f"{idx_path} is not a Megatron indexed dataset's index (it does not start with "
                        f"{INDEX_HEADER!r}); create the dataset with fe-data preprocess")
    version, code = struct.unpack("<QB", header[len(INDEX_HEADER):])
    if version != 1 or code not in INDEX_DTYPES:
        raise DataError(f"{idx_path} has index version {version} and dtype code {code}; expected version 1 and an "
                        f"integer dtype (codes {sorted(INDEX_DTYPES)}); re-create the dataset with fe-data preprocess")
    return INDEX_DTYPES[code]


def token_id_range(bin_path: str, dtype) -> Optional[tuple]:
    """``(smallest, largest, how they were found)`` over a ``.bin`` file's token ids, None when it
    holds none: every token of a file up to ``FULL_SCAN_BYTES``, else ``SAMPLE_WINDOWS`` windows."""
    size, itemsize = os.path.getsize(bin_path), numpy.dtype(dtype).itemsize
    if size % itemsize:
        raise DataError(f"{bin_path} holds {size} bytes, not a whole number of {numpy.dtype(dtype).name} token ids "
                        f"(the dtype its .idx names): the file is truncated or belongs to another index; re-create "
                        f"it with fe-data preprocess")
    if size == 0:
        return None
    tokens = numpy.memmap(bin_path, dtype=dtype, mode="r")
    if size <= FULL_SCAN_BYTES:
        pieces = [tokens[start:start + CHUNK_TOKENS] for start in range(0, len(tokens), CHUNK_TOKENS)]
        how = "every token read"
    else:
        window = WINDOW_BYTES // itemsize
        starts = numpy.linspace(0, len(tokens) - window, SAMPLE_WINDOWS).astype(numpy.int64)
        pieces = [tokens[start:start + window] for start in starts]
        how = f"read in {SAMPLE_WINDOWS} evenly spaced windows of {_size(WINDOW_BYTES)} of its {_size(size)}"
    smallest = min(int(piece.min()) for piece in pieces)
    largest = max(int(piece.max()) for piece in pieces)
    del tokens
    return smallest, largest, how


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
