"""Communication hooks of a memory branch: identity in a single process.

`FactorEngram` and `Engram` are written once, for one process.  Where a parallel layout needs
communication, the branch calls one of these hooks; an adapter overrides them for its layout
(`fe_megatron.megatron.memory_parallel.MegatronParallelHooks` for Megatron's tensor, sequence
and context parallelism), the way Megatron-Core's MoE layer is one implementation for every
expert-parallel size with the communication in its token dispatcher.

Under tensor parallelism rank ``r`` of ``tp`` holds columns ``[r w, (r+1) w)`` of every branch's
table (``w = s_b / tp``) and the parameters split like them (`fe_megatron.memory.sharding`), so
the branch computes *partial* results over its coefficients, which `sum_partial_results` adds up.
"""

from __future__ import annotations

import torch


class ParallelHooks:
    """What a memory branch needs to know about, and ask of, its parallel layout.

    Attributes:
      tensor_parallel_size, tensor_parallel_rank: the column split of the tables (shapes only).
      memory_parallel_group: the process group the tables' rows are sharded over
        (`fe_megatron.tables.row_exchange`), or None when every rank holds whole tables.
      sequence_dim: 1 for ``[batch, seq, ...]`` tensors (the default), 0 for Megatron's
        sequence-first ``[seq, batch, ...]``.
    """

    tensor_parallel_size = 1
    tensor_parallel_rank = 0
    memory_parallel_group = None
    sequence_dim = 1

    def replicate_for_partial_use(self, x: torch.Tensor) -> torch.Tensor:
        """An activation that every rank uses with its own coefficients (forward: make it whole
        on every rank; backward: sum the ranks' gradients)."""
        return x

    def sum_partial_results(self, x: torch.Tensor) -> torch.Tensor:
        """Add up the ranks' partial results over their own coefficients (and, under sequence
        parallelism, keep this rank's tokens)."""
        return x

    def short_conv(self, conv, values: torch.Tensor) -> torch.Tensor:
        """Eq. 10's causal refinement of ``values`` (this rank's tokens), with whatever history
        from other ranks the layout needs."""
        return conv(values, sequence_dim=self.sequence_dim)

    def index_sequence_length(self, hidden_sequence_length: int) -> int:
        """Positions covered by the row indices when the hidden states hold ``hidden_sequence_length``
        (sequence parallelism splits the hidden states by tokens but not the indices)."""
        return hidden_sequence_length


SINGLE_PROCESS = ParallelHooks()
