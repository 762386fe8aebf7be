"""NgramTables: every branch's table E_b of one layer in a single buffer (Eq. 2 and 6).

The rows are FactorEngram's coefficients z or Engram's dense embeddings; both are addressed
the same way, by n-gram (`fe_megatron.ngram`).
"""

import torch
import torch.nn as nn

from fe_megatron import ops


class NgramTables(nn.Module):
    """``weight``: [total_rows, width]; branch b owns rows ``[offset_b, offset_b + M_b)``.

    ``forward(indices)`` gathers all branches in one kernel call and concatenates them in the
    fixed branch order: [..., branches] -> [..., branches * width] (``z_t`` of Eq. 6).  Under
    tensor parallelism ``width`` is this rank's column slice of ``s_b``, and the result is its
    slice of every branch, branch-major.
    """

    def __init__(self, total_rows: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(total_rows, width))

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return ops.gather_rows(self.weight, indices).flatten(-2)  # [..., nb, w] -> [..., nb * w]
