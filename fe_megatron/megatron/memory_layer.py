"""Tensor- and sequence-parallel memory branches: `ParallelFactorEngram` and `ParallelEngram`.

The math is `fe_megatron.memory.functional`, shared with the single-process modules;
this file adds only the split and the communication (docs/parallelism.md).

Split (FactorEngram): the coefficient axis s.  Rank r holds columns ``[r w, (r+1) w)``
of every branch's table (w = s_b / tp) and the matching dictionary rows, so the basis
gate and the reconstruction are local and produce a partial sum of ``e_t`` over the
rank's coefficients.  Q, its norm, V and the convolution are small (2 d d_m) and stay
whole on every rank.  Per layer and token this costs one all-reduce of d_m values
forward (the partial ``e_t``) and one backward (the query's gradient, which is partial
because each rank gates different coefficients) -- versus one of d each way for a
Megatron MLP.  With sequence parallelism the two become a reduce-scatter and an
all-gather of d_m values, Q/V/conv see only local tokens (their gradients are summed
across TP like other sequence-parallel parameters), and the causal convolution reads
its ``(K-1) r`` rows of history from the previous rank.

Engram (dense) splits the embedding columns the same way, together with the input
columns of the key and value projections: two all-reduces (or reduce-scatters) of d
forward, none backward.

Context parallelism: each CP rank holds two load-balanced sequence chunks; everything is
per token except the convolution, which receives each chunk's predecessor rows from
the rank holding them (`_ContextParallelHalos`).

Layout: Megatron's sequence-first ``[s, b, h]``; indices ``[s, b, branches]`` cover the
rank's whole (CP-local) sequence, also under SP (the tables are split by columns, not by tokens).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from megatron.core import parallel_state
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron.tables import ParallelCoefficientTables
from fe_megatron.memory import functional as FM
from fe_megatron.memory.short_conv import ShortConv
from fe_megatron.ngram import NgramHasher


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
    2cp-1-r. Each chunk's causal convolution needs the last rows of the chunk before it,
    which lives on another rank (or is zero padding for chunk 0). Forward all-gathers both
    chunks' tails from every rank and returns the two halos this rank needs; backward
    scatters the halos' gradients back to their owners with one all-reduce. Every rank runs
    the same collectives."""

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


class BranchShardedLinear(nn.Module):
    """A linear map whose input is the branch-major local coefficient slice (Engram's projections).

    ``weight``: local ``[out, branches, w]``; globally ``[out, branches, s_b]`` (= nn.Linear's
    ``[out, s]`` viewed per branch), split along axis 2 like the tables.
    """

    def __init__(self, out_features: int, num_branches: int, local_width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, num_branches, local_width))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=2, stride=1)

    def forward(self, local_coefficients: torch.Tensor) -> torch.Tensor:
        return torch.matmul(local_coefficients, self.weight.flatten(1).t())


class _ParallelMemoryBase(MegatronModule):
    """Shared plumbing: TP/SP groups, the sharded tables, the halo convolution, checkpointing."""

    _TP_AXES: dict = {"tables.weight": 1}

    def __init__(self, config: TransformerConfig, memory_config: MemoryConfig, layer_index: int,
                 tp_group: Optional[dist.ProcessGroup] = None):
        super().__init__(config=config)
        self.memory_config = memory_config
        self.layer_index = layer_index
        self.tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        self.tp_size = dist.get_world_size(self.tp_group)
        self.tp_rank = dist.get_rank(self.tp_group)
        self.sequence_parallel = bool(config.sequence_parallel) and self.tp_size > 1
        self.cp_group = parallel_state.get_context_parallel_group() if config.context_parallel_size > 1 else None
        if self.cp_group is not None and self.sequence_parallel:
            raise NotImplementedError("context parallelism together with sequence parallelism is not supported by "
                                      "the memory branch yet; use one of them")
        hasher = NgramHasher(memory_config, layer_index)
        self.tables = ParallelCoefficientTables(hasher.total_rows(layer_index), memory_config.branch_width,
                                                self.tp_size, perform_initialization=config.perform_initialization)
        self.local_width = self.tables.local_width
        self.conv = ShortConv(memory_config.output_size, memory_config.conv_kernel_size,
                              memory_config.conv_dilation, memory_config.norm_eps)

    # ----------------------------------------------------------------- communication
    def _full_sequence_for_partial_use(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated activation that each rank uses for its own coefficients (backward: sum)."""
        if self.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(x, group=self.tp_group)
        return mappings.copy_to_tensor_model_parallel_region(x, group=self.tp_group)

    def _sum_partials(self, x: torch.Tensor) -> torch.Tensor:
        """Sum per-rank partial results (and scatter the sequence under SP)."""
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(x, group=self.tp_group)
        return mappings.reduce_from_tensor_model_parallel_region(x, group=self.tp_group)

    def _mark_sequence_parallel(self, *modules: nn.Module) -> None:
        """Replicated parameters that see only local tokens under SP: TP sums their gradients."""
        for module in modules:
            for param in module.parameters():
                param.sequence_parallel = self.sequence_parallel

    def _short_conv(self, values: torch.Tensor) -> torch.Tensor:
        """Eq. 10's refinement on ``[s_local, b, C]``, with the previous rank's rows as history under SP."""
        if self.cp_group is not None:
            return self._short_conv_context_parallel(values)
        history = 0
        if self.sequence_parallel:
            reach = self.conv.receptive_field
            if values.shape[0] < reach:
                raise ValueError(f"sequence-parallel chunk of {values.shape[0]} tokens is shorter than the "
                                 f"convolution's reach (K-1)*dilation={reach}; use a longer sequence or smaller TP")
            # rank 0 gets zero rows: RMSNorm(0) = 0, the same as the convolution's zero padding
            values = torch.cat([_PreviousRankRows.apply(values[-reach:], self.tp_group), values], 0)
            history = reach
        return self.conv(values.transpose(0, 1), history=history).transpose(0, 1)

    def _short_conv_context_parallel(self, values: torch.Tensor) -> torch.Tensor:
        """The convolution over this CP rank's two load-balanced chunks, each with its predecessor's rows."""
        reach = self.conv.receptive_field
        chunks = values.chunk(2, dim=0)
        if chunks[0].shape[0] < reach:
            raise ValueError(f"context-parallel chunk of {chunks[0].shape[0]} tokens is shorter than the "
                             f"convolution's reach (K-1)*dilation={reach}; use a longer sequence or smaller CP")
        halos = _ContextParallelHalos.apply(torch.stack([chunk[-reach:] for chunk in chunks]), self.cp_group)
        outs = [self.conv(torch.cat([halo, chunk], 0).transpose(0, 1), history=reach).transpose(0, 1)
                for halo, chunk in zip(halos, chunks)]  # zero halo rows = zero padding (RMSNorm(0) = 0)
        return torch.cat(outs, 0)

    # ----------------------------------------------------------------- checkpointing
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, self._TP_AXES, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=parallel_state.get_data_parallel_group(
                                                       with_context_parallel=True))


class ParallelFactorEngram(_ParallelMemoryBase):
    """FactorEngram (Eq. 6-12) split over the coefficient axis; see the module docstring.

    ``forward(hidden_states [s_local, b, d], indices [s, b, branches])`` returns
    ``(m [s_local, b, output_size], l1 [s, b])`` where ``l1`` is this rank's share of
    ``||z_t||_1`` (the shares sum to the full norm over TP ranks).

    Parameters: ``tables.weight`` [rows, w]; ``dictionary`` [branches, w, d_m] (the rows of
    D for this rank's coefficients; globally [branches, s_b, d_m] = D viewed per branch);
    ``query_proj.weight``, ``query_norm.weight``, ``value_proj.weight``, ``conv.*`` whole.
    Initialization as in `fe_megatron.memory.FactorEngram`.
    """

    _TP_AXES = {"tables.weight": 1, "dictionary": 1}

    def __init__(self, config: TransformerConfig, memory_config: MemoryConfig, layer_index: int,
                 tp_group: Optional[dist.ProcessGroup] = None):
        super().__init__(config, memory_config, layer_index, tp_group)
        mc = memory_config
        self.dictionary = nn.Parameter(torch.empty(mc.num_branches, self.local_width, mc.memory_dim))
        set_tensor_model_parallel_attributes(self.dictionary, is_parallel=True, dim=1, stride=1)
        if mc.gate != "none":
            self.query_proj = nn.Linear(mc.hidden_size, mc.memory_dim, bias=False)
            self.query_norm = nn.RMSNorm(mc.memory_dim, eps=mc.norm_eps)
            self._mark_sequence_parallel(self.query_proj, self.query_norm)
        self.value_proj = nn.Linear(mc.memory_dim, mc.output_size, bias=False)
        self._mark_sequence_parallel(self.value_proj, self.conv)
        if config.perform_initialization:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                nn.init.normal_(self.dictionary, std=1.0 / math.sqrt(mc.coeff_width))
            if mc.gate != "none":
                nn.init.normal_(self.query_proj.weight, std=mc.init_std)
            nn.init.zeros_(self.value_proj.weight)

    def forward(self, hidden_states: torch.Tensor, indices: torch.Tensor):
        mc = self.memory_config
        coefficients = self.tables(indices).to(hidden_states.dtype)  # this rank's columns of z_t, Eq. 6
        l1 = FM.l1_per_position(coefficients)  # this rank's share of Eq. 12
        dictionary = self.dictionary.flatten(0, 1)
        query = None
        if mc.gate != "none":
            query = self.query_norm(self.query_proj(hidden_states))  # Eq. 7, on local tokens
        if mc.gate == "basis":
            alpha = FM.basis_gate(self._full_sequence_for_partial_use(query), dictionary, mc.hidden_size)
            memory = self._sum_partials(FM.reconstruct(coefficients * alpha, dictionary))  # Eq. 8-9
        else:
            memory = self._sum_partials(FM.reconstruct(coefficients, dictionary))
            if mc.gate == "scalar":
                memory = FM.scalar_gate(memory, query, mc.hidden_size) * memory  # Eq. 11
        values = self.value_proj(memory)  # Eq. 9
        return values + self._short_conv(values), l1  # Eq. 10


class ParallelEngram(_ParallelMemoryBase):
    """DeepSeek's Engram (see `fe_megatron.memory.Engram`) with embedding columns split over TP.

    Parameters: ``tables.weight`` [rows, w]; ``value_proj.weight`` [out, branches, w] and
    ``key_proj.weight`` [d, branches, w] (split like the tables); ``key_norm``,
    ``query_norm``, ``conv.*`` whole.
    """

    _TP_AXES = {"tables.weight": 1, "value_proj.weight": 2, "key_proj.weight": 2}

    def __init__(self, config: TransformerConfig, memory_config: MemoryConfig, layer_index: int,
                 tp_group: Optional[dist.ProcessGroup] = None):
        super().__init__(config, memory_config, layer_index, tp_group)
        mc = memory_config
        self.value_proj = BranchShardedLinear(mc.output_size, mc.num_branches, self.local_width)
        if mc.gate == "scalar":
            self.key_proj = BranchShardedLinear(mc.hidden_size, mc.num_branches, self.local_width)
            self.key_norm = nn.RMSNorm(mc.hidden_size, eps=mc.norm_eps)
            self.query_norm = nn.RMSNorm(mc.hidden_size, eps=mc.norm_eps)
            self._mark_sequence_parallel(self.key_norm, self.query_norm)
        self._mark_sequence_parallel(self.conv)
        if config.perform_initialization:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            nn.init.zeros_(self.value_proj.weight)  # as in fe_megatron.memory.Engram
            with get_cuda_rng_tracker().fork():
                if mc.gate == "scalar":
                    nn.init.normal_(self.key_proj.weight, std=mc.init_std)

    def forward(self, hidden_states: torch.Tensor, indices: torch.Tensor):
        mc = self.memory_config
        embeddings = self.tables(indices).to(hidden_states.dtype)
        l1 = FM.l1_per_position(embeddings)
        values = self._sum_partials(self.value_proj(embeddings))
        if mc.gate == "scalar":
            key = self.key_norm(self._sum_partials(self.key_proj(embeddings)))
            values = FM.engram_gate(key, self.query_norm(hidden_states), mc.hidden_size) * values
        return values + self._short_conv(values), l1


def build_parallel_memory(config: TransformerConfig, memory_config: MemoryConfig, layer_index: int,
                          tp_group: Optional[dist.ProcessGroup] = None):
    cls = ParallelFactorEngram if memory_config.representation == "factorized" else ParallelEngram
    return cls(config, memory_config, layer_index, tp_group)
