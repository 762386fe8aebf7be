"""Coefficient tables sharded by columns across tensor-parallel ranks.

Every branch's ``s_b`` columns are split into ``tp`` slices of ``w = s_b / tp``; rank r
holds columns ``[r w, (r + 1) w)`` of every branch, so each rank gathers every looked-up
row but moves only ``1/tp`` of its bytes, and no rank ever holds a whole table.  The
local coefficients are branch-major: ``z_r[b w + j] = z[b s_b + r w + j]``, matching the
dictionary shard of `ParallelFactorEngram`.
"""

import torch
import torch.nn as nn
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from fe_megatron import ops


class ParallelCoefficientTables(nn.Module):
    """``weight``: local ``[total_rows, s_b / tp]``; the global tensor is ``[total_rows, s_b]``."""

    def __init__(self, total_rows: int, branch_width: int, tp_size: int, init_std: float = 1.0,
                 perform_initialization: bool = True):
        super().__init__()
        if branch_width % tp_size:
            raise ValueError(f"tensor-parallel size {tp_size} does not divide the branch width s_b={branch_width} "
                             "(MemoryConfig.coeff_width / num_branches); choose coeff_width so that s_b % tp == 0")
        self.local_width = branch_width // tp_size
        self.weight = nn.Parameter(torch.empty(total_rows, self.local_width))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=1, stride=1)
        self.weight.allreduce = True
        if perform_initialization:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():  # distinct streams per TP rank, like Megatron's TP layers
                nn.init.normal_(self.weight, std=init_std)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """[..., nb] row indices -> [..., nb * w] local coefficients, branch-major."""
        return ops.gather_rows(self.weight, indices).flatten(-2)
