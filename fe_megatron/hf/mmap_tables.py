"""Tables read from the safetensors files, memory-mapped: ``table_storage="mmap"``.

The tables are most of a FactorEngram model's bytes, and a forward reads only the rows its
tokens address.  With ``from_pretrained(DIR, table_storage="mmap")`` each table stays in its
safetensors file: the model holds a tensor over a private, copy-on-write mapping of the file's
bytes (`numpy.memmap`, mode ``"c"``, advised as randomly accessed so the kernel reads no pages
around a row), so a gather reads only the pages of the rows it needs and resident memory grows
with the rows used, not with the table.  The tables keep the file's dtype whatever ``dtype`` the
rest of the model is loaded in.  Every other weight loads as transformers loads it.

The header parsing is safetensors' format (8-byte little-endian header length, a JSON header of
dtypes, shapes and byte offsets, then the data), written here because ``safe_open`` returns
copies, not views of the mapping.
"""

from __future__ import annotations

import json
import mmap
import os
import struct

import numpy
import torch

from fe_megatron.hf.safetensors_stream import DTYPES, INDEX

_TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
TABLE_STORAGES = ("memory", "mmap")


def _weight_files(directory: str) -> dict:
    """``{tensor name: file path}`` of a transformers checkpoint directory."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        with open(index) as fh:
            return {name: os.path.join(directory, file) for name, file in json.load(fh)["weight_map"].items()}
    single = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"table_storage='mmap' reads the tables from a local directory's safetensors files; "
                                f"{directory} has neither model.safetensors nor {INDEX} (download the model first, "
                                "or load it with table_storage='memory')")
    return {name: single for name in _header(single)[0] if name != "__metadata__"}


def _header(path: str) -> tuple:
    """``(header, data_start)`` of a safetensors file."""
    with open(path, "rb") as fh:
        length = struct.unpack("<Q", fh.read(8))[0]
        return json.loads(fh.read(length)), 8 + length


def mapped_tensor(path: str, name: str) -> torch.Tensor:
    """Tensor ``name`` of safetensors file ``path`` as a view of a copy-on-write mapping of it."""
    header, start = _header(path)
    entry = header[name]
    first, last = entry["data_offsets"]
    dtype = _TORCH_DTYPES[entry["dtype"]]
    if last == first:
        return torch.empty(entry["shape"], dtype=dtype)
    raw = numpy.memmap(path, dtype=numpy.uint8, mode="c", offset=start + first, shape=(last - first,))
    if hasattr(mmap, "MADV_RANDOM"):  # rows are read at hashed addresses: no read-ahead around them
        raw._mmap.madvise(mmap.MADV_RANDOM)
    return torch.from_numpy(raw).view(dtype).view(entry["shape"])


def map_tables(model, directory: str) -> None:
    """Point every memory branch's ``tables.weight`` of ``model`` (a `FactorEngramModel`) at its
    bytes in ``directory``'s safetensors files."""
    map_layer_tables({index: model.layers[index].memory.tables for index in model.memory_layers}, directory)


def map_layer_tables(tables: dict, directory: str) -> None:
    """Point each ``{layer index: NgramTables}``'s ``weight`` at its bytes (``layers.N.memory.tables.weight``)
    in ``directory``'s safetensors files; the tables were released for it (``release_for_mapping``)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"table_storage='mmap' needs a local directory, got {directory!r}: download the "
                                "model first (huggingface_hub.snapshot_download), or use table_storage='memory'")
    files = _weight_files(directory)
    prefix = "" if any(name.startswith("layers.") for name in files) else "model."
    for index, layer_tables in tables.items():
        name = f"{prefix}layers.{index}.memory.tables.weight"
        if name not in files:
            raise KeyError(f"{directory} has no tensor {name}")
        weight = mapped_tensor(files[name], name)
        stored = layer_tables.table_dtype != "fp32"  # a serving format: the file must hold exactly it
        if tuple(weight.shape) != tuple(layer_tables.weight.shape) or \
                (stored and weight.dtype != layer_tables.weight.dtype):
            raise ValueError(f"{name} in {directory} is {weight.dtype} {tuple(weight.shape)}; the config says "
                             f"{layer_tables.weight.dtype if stored else 'a'} {tuple(layer_tables.weight.shape)} table")
        layer_tables.weight = weight
