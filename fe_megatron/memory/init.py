"""Initialization that does not depend on the parallel layout.

A parameter's values are a function of its global shape, a seed, and the global index of each
row (axis 0): rows come in blocks of `ROWS_PER_STREAM`, and block ``k`` is drawn from a generator
seeded with ``(seed, k)``.  A rank that holds a tensor-parallel slice of the columns, or (with
row-sharded tables) a range of rows, draws only the blocks that overlap its rows and keeps its
part, so no rank ever materializes a whole table and a table is the same at every TP size and
every row-sharding group size.  Values are drawn on the CPU (generators differ between devices)
and copied to the parameter's device.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

ROWS_PER_STREAM = 1024
_MASK63 = (1 << 63) - 1


def stream_seed(seed: int, name: str, block: int = 0) -> int:
    """A 63-bit seed for block ``block`` of parameter ``name`` (splitmix64 finalizer of the three)."""
    z = (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode()) * 0xBF58476D1CE4E5B9 + block) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


@torch.no_grad()
def normal_by_global_rows_(param: torch.Tensor, std: float, seed: int, name: str, global_shape: tuple,
                           split_dim: Optional[int] = None, split_rank: int = 0, split_size: int = 1,
                           row_offset: int = 0) -> torch.Tensor:
    """Fill ``param`` with its part of a global N(0, std^2) tensor of shape ``global_shape``.

    ``param`` holds global rows ``[row_offset, row_offset + param.shape[0])`` and, when
    ``split_dim`` is given (not 0), slice ``split_rank`` of ``split_size`` along ``split_dim``.
    """
    if split_dim == 0:
        raise ValueError("split rows with row_offset, not split_dim=0")
    rows = param.shape[0]
    first, last = row_offset // ROWS_PER_STREAM, (row_offset + rows - 1) // ROWS_PER_STREAM
    for block in range(first, last + 1):
        start = block * ROWS_PER_STREAM
        stop = min(start + ROWS_PER_STREAM, global_shape[0])
        generator = torch.Generator().manual_seed(stream_seed(seed, name, block))
        values = torch.randn((stop - start,) + tuple(global_shape[1:]), generator=generator).mul_(std)
        if split_dim is not None:
            width = global_shape[split_dim] // split_size
            values = values.narrow(split_dim, split_rank * width, width)
        lo, hi = max(start, row_offset), min(stop, row_offset + rows)
        param[lo - row_offset:hi - row_offset].copy_(values[lo - start:hi - start])
    return param


def draw_seed() -> int:
    """A base seed from torch's default generator: modules built one after another differ, as
    ``nn.Linear`` weights do, and processes seeded alike (Megatron seeds every tensor- and
    data-parallel rank of a pipeline stage alike) agree."""
    return int(torch.randint(0, _MASK63, (), dtype=torch.int64))
