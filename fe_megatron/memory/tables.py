"""CoefficientTables: every branch's table E_b of one layer in a single buffer (Eq. 6)."""

import torch
import torch.nn as nn

from fe_megatron import ops


class CoefficientTables(nn.Module):
    """``weight``: [total_rows, s_b]; branch b owns rows ``[offset_b, offset_b + M_b)``.

    ``forward(indices)`` gathers all branches in one kernel call and concatenates them
    in the fixed branch order: [batch, seq, nb] -> [batch, seq, nb * s_b] = z_t.
    """

    def __init__(self, total_rows: int, branch_width: int, init_std: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(total_rows, branch_width))
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        rows = ops.gather_rows(self.weight, indices)  # [B, T, nb, s_b]
        return rows.flatten(-2)
