"""Row deduplication, the one implementation every lookup uses.

A microbatch reads many rows more than once (a token recurs in its window; every position reads
its unigram row), so each lookup gathers, sends and updates each distinct row once: `unique_rows`
gives the sorted distinct ids and, for every position, the index of its id among them; in backward
`sum_per_row` adds the positions' gradients per distinct row, with the kernels of `fe_megatron.ops`
(sorted and reproducible unless ``deterministic`` is False).  Used by `StoreLookup` and the row
gradients of a store (`fe_megatron.tables.store`), and by the row exchange
(`fe_megatron.tables.row_exchange.StageRowExchange`).
"""

from __future__ import annotations

from typing import Optional

import torch

from fe_megatron import ops


def unique_rows(ids: torch.Tensor) -> tuple:
    """``(unique, inverse)``: the sorted distinct ids of ``ids`` ([M] int64) and, per position, its id's
    index in ``unique`` (``unique[inverse] == ids``)."""
    return torch.unique(ids, sorted=True, return_inverse=True)


def sum_per_row(grad_rows: torch.Tensor, inverse: torch.Tensor, count: int, deterministic: bool = True,
                backend: Optional[str] = None) -> torch.Tensor:
    """``[count, width]`` fp32: the rows of ``grad_rows`` ([M, width]) summed by ``inverse`` ([M])."""
    sums = torch.zeros(count, grad_rows.shape[1], dtype=torch.float32, device=grad_rows.device)
    ops.gather_rows_backward(grad_rows, inverse, sums, deterministic, backend)
    return sums


def unique_row_sums(ids: torch.Tensor, grad_rows: torch.Tensor, deterministic: bool = True,
                    backend: Optional[str] = None) -> tuple:
    """``(unique ids, [unique, width] fp32 sums of grad_rows per id)``."""
    unique, inverse = unique_rows(ids)
    return unique, sum_per_row(grad_rows, inverse, unique.numel(), deterministic, backend)
