"""Write safetensors shards one tensor at a time, and read them one tensor (or row range) at a time.

`safetensors.torch.save_file` takes a whole state dict and serializes each tensor to a bytes
object first: a second copy of every table.  The format is simple (an 8-byte header length, a
JSON header of names, dtypes, shapes and byte offsets, then the raw little-endian data), so the
writer here plans the header from shapes alone and then writes each tensor's bytes straight
from its memory.  The reader is safetensors' own ``safe_open``, whose slices read row ranges.
Shards follow transformers' layout: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
with a ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable

import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
          torch.float8_e4m3fn: "F8_E4M3"}
INDEX = "model.safetensors.index.json"


def tensor_bytes(shape, dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    count = 1
    for size in shape:
        count *= int(size)
    return count * torch.empty((), dtype=dtype).element_size()


def plan_shards(groups: list, max_shard_bytes: int) -> list:
    """Split ``groups`` (``[(source, [(name, shape, dtype)])]``, the tensors one source yields) into
    shards of at most ``max_shard_bytes`` (a larger group gets a shard of its own); a source's
    tensors always share a shard, so every source is read once."""
    shards, current, size = [], [], 0
    for source, entries in groups:
        group_bytes = sum(tensor_bytes(shape, dtype) for _, shape, dtype in entries)
        if current and size + group_bytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((source, entries))
        size += group_bytes
    if current:
        shards.append(current)
    return shards


def write_shards(directory: str, groups: list, produce: Callable[[object], Iterable], metadata: dict = None,
                 max_shard_bytes: int = 2 << 30, progress: Callable[[str, int], None] = None) -> list:
    """Write the tensors of ``groups`` (see `plan_shards`) into ``directory``; ``produce(source)``
    returns that source's ``[(name, tensor)]`` in the planned order, when its shard is written.
    Returns the file names."""
    shards = plan_shards(groups, max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file_name, shard in zip(names, shards):
        header, offset = {}, 0
        for _, entries in shard:
            for name, shape, dtype in entries:
                if dtype not in DTYPES:
                    raise TypeError(f"{name}: dtype {dtype} cannot be written to safetensors")
                nbytes = tensor_bytes(shape, dtype)
                header[name] = {"dtype": DTYPES[dtype], "shape": [int(s) for s in shape],
                                "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
                weight_map[name] = file_name
        total += offset
        header["__metadata__"] = {"format": "pt", **(metadata or {})}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(os.path.join(directory, file_name), "wb") as fh:
            fh.write(struct.pack("<Q", len(encoded)))
            fh.write(encoded)
            for source, entries in shard:
                produced = list(produce(source))
                expected = [(name, tuple(shape), dtype) for name, shape, dtype in entries]
                got = [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in produced]
                if got != expected:
                    raise RuntimeError(f"{source}: produced {got}, planned {expected}")
                for name, tensor in produced:
                    data = tensor.detach().contiguous().reshape(-1)
                    fh.write(memoryview(data.view(torch.uint8).numpy()) if data.numel() else b"")
                    if progress is not None:
                        progress(name, data.numel() * data.element_size())
                del produced
    if len(names) > 1:
        with open(os.path.join(directory, INDEX), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1, sort_keys=True)
    return names


class SafetensorsSource:
    """The tensors of a transformers checkpoint directory, read one at a time (memory-mapped)."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as fh:
                weight_map = {name: "model.safetensors" for name in fh.keys()}
        else:
            raise FileNotFoundError(f"{directory} has no model.safetensors or {INDEX}: not a transformers "
                                    "checkpoint in safetensors format")
        self.directory = directory
        self.weight_map = weight_map
        self._open = {}
        self._safe_open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def __str__(self) -> str:
        return self.directory

    def names(self) -> list:
        return list(self.weight_map)

    def _file(self, name: str):
        file_name = self.weight_map[name]
        if file_name not in self._open:
            self._open[file_name] = self._safe_open(os.path.join(self.directory, file_name), framework="pt")
        return self._open[file_name]

    def shape(self, name: str) -> tuple:
        return tuple(self._file(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def rows(self, name: str, first: int, last: int) -> torch.Tensor:
        return self._file(name).get_slice(name)[first:last]

    def close(self) -> None:
        """Drop the open files (safetensors unmaps a file when its handle goes)."""
        self._open = {}
