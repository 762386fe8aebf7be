"""The memory branch's communication under Megatron's tensor, sequence and context parallelism.

`MegatronParallelHooks` implements `fe_megatron.memory.ParallelHooks` (the branch itself is the
single-process `FactorEngram` / `Engram`); this is the memory analogue of MoE's token
dispatcher.  Layout: Megatron's sequence-first ``[s, b, h]``; the row indices ``[s, b,
branches]`` cover the rank's whole (CP-local) sequence, also under SP, because the tables are
split by columns, not by tokens.

Tensor parallelism (the sharding plan splits the coefficient axis): every rank gathers its
columns of every looked-up row, gates and reconstructs them against its rows of D, and so
produces a partial ``e_t``.  Per layer and token this costs one all-reduce of d_m values forward
(`sum_partial_results`) and, for the basis gate, one backward (the query's gradient, partial
because each rank gates different coefficients; `replicate_for_partial_use`).

Sequence parallelism: the two become a reduce-scatter and an all-gather of d_m values; Q, V and
the convolution see only local tokens, and the causal convolution reads its ``(K-1) r`` rows
of history from the previous rank (`_PreviousRankRows`).

Context parallelism: each CP rank holds two load-balanced sequence chunks; everything is per
token except the convolution, which receives each chunk's predecessor rows from the rank
holding them (`_ContextParallelHalos`).  The rationale and costs: docs/parallelism.md.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import mappings

from fe_megatron.memory import ParallelHooks


class _PreviousRankRows(torch.autograd.Function):
    """Each rank receives the previous TP rank's rows (rank 0: zeros); backward returns the
    gradient to the sender.  Every rank uses its output, so forward and backward run the same
    collectives in the same order on all ranks."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group):
        ctx.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        gathered = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(gathered, rows.contiguous(), group=group)
        return gathered[rank - 1] if rank > 0 else torch.zeros_like(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        gathered = [torch.empty_like(grad) for _ in range(size)]
        dist.all_gather(gathered, grad.contiguous(), group=ctx.group)
        return (gathered[rank + 1] if rank + 1 < size else torch.zeros_like(grad)), None


class _ContextParallelHalos(torch.autograd.Function):
    """Megatron's load-balanced context parallelism gives CP rank r the sequence chunks r and
    2cp-1-r. Each chunk's causal convolution needs the last rows of the chunk before it, which
    lives on another rank (or is zero padding for chunk 0). Forward all-gathers both chunks'
    tails from every rank and returns the two halos this rank needs; backward scatters the
    halos' gradients back to their owners with one all-reduce. Every rank runs the same
    collectives."""

    @staticmethod
    def forward(ctx, tails: torch.Tensor, group):  # tails: [2, R, b, C]
        ctx.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        gathered = [torch.empty_like(tails) for _ in range(size)]
        dist.all_gather(gathered, tails.contiguous(), group=group)
        ctx.sources = [_cp_chunk_location(chunk - 1, size) for chunk in _cp_local_chunks(rank, size)]
        halos = [torch.zeros_like(tails[0]) if src is None else gathered[src[0]][src[1]] for src in ctx.sources]
        return torch.stack(halos)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        buffer = torch.zeros((size,) + tuple(grad.shape), dtype=grad.dtype, device=grad.device)
        for halo, src in enumerate(ctx.sources):
            if src is not None:
                buffer[src[0], src[1]] += grad[halo]
        dist.all_reduce(buffer, group=ctx.group)
        return buffer[dist.get_rank(ctx.group)], None


def _cp_local_chunks(rank: int, size: int):
    return (rank, 2 * size - 1 - rank)


def _cp_chunk_location(chunk: int, size: int):
    """(rank, local slot) holding global chunk ``chunk`` in the load-balanced layout, None for chunk -1."""
    if chunk < 0:
        return None
    return (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)


class MegatronParallelHooks(ParallelHooks):
    """TP (with or without SP) and CP communication for one memory branch, sequence-first; with
    ``memory_parallel_group`` the tables' rows are sharded over it (the row exchange itself is
    `fe_megatron.tables.row_exchange`, shared with every engine)."""

    sequence_dim = 0

    def __init__(self, tp_group: dist.ProcessGroup, sequence_parallel: bool,
                 cp_group: Optional[dist.ProcessGroup] = None,
                 memory_parallel_group: Optional[dist.ProcessGroup] = None):
        self.tp_group = tp_group
        self.memory_parallel_group = memory_parallel_group
        self.tensor_parallel_size = dist.get_world_size(tp_group)
        self.tensor_parallel_rank = dist.get_rank(tp_group)
        self.sequence_parallel = bool(sequence_parallel) and self.tensor_parallel_size > 1
        self.cp_group = cp_group if cp_group is not None and dist.get_world_size(cp_group) > 1 else None
        if self.cp_group is not None and self.sequence_parallel:
            raise NotImplementedError("context parallelism together with sequence parallelism is not supported by "
                                      "the memory branch yet; use one of them")

    def replicate_for_partial_use(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(x, group=self.tp_group)
        return mappings.copy_to_tensor_model_parallel_region(x, group=self.tp_group)

    def sum_partial_results(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(x, group=self.tp_group)
        return mappings.reduce_from_tensor_model_parallel_region(x, group=self.tp_group)

    def index_sequence_length(self, hidden_sequence_length: int) -> int:
        return hidden_sequence_length * (self.tensor_parallel_size if self.sequence_parallel else 1)

    def short_conv(self, conv, values: torch.Tensor) -> torch.Tensor:
        """Eq. 10's refinement of ``[s_local, b, C]``: with the previous TP rank's rows as history
        under SP, and each load-balanced chunk with its predecessor's rows under CP."""
        reach = conv.receptive_field
        if self.cp_group is not None:
            chunks = values.chunk(2, dim=0)
            _check_reach(chunks[0].shape[0], reach, "context-parallel chunk", "CP")
            halos = _ContextParallelHalos.apply(torch.stack([chunk[-reach:] for chunk in chunks]), self.cp_group)
            # zero halo rows are the convolution's zero padding (RMSNorm(0) = 0)
            return torch.cat([conv(torch.cat([halo, chunk], 0), history=reach, sequence_dim=0)
                              for halo, chunk in zip(halos, chunks)], 0)
        if not self.sequence_parallel:
            return conv(values, sequence_dim=0)
        _check_reach(values.shape[0], reach, "sequence-parallel chunk", "TP")
        # rank 0 gets zero rows: RMSNorm(0) = 0, the same as the convolution's zero padding
        values = torch.cat([_PreviousRankRows.apply(values[-reach:], self.tp_group), values], 0)
        return conv(values, history=reach, sequence_dim=0)


def _check_reach(tokens: int, reach: int, what: str, size_name: str) -> None:
    if tokens < reach:
        raise ValueError(f"{what} of {tokens} tokens is shorter than the convolution's reach "
                         f"(K-1)*dilation={reach}; use a longer sequence or a smaller {size_name} size")
