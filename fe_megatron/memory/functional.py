"""The equations of the memory branch as functions of tensors (paper Sec. 3 and 4.3).

`FactorEngram` and `Engram` call these; each equation is written exactly once.  Under tensor
parallelism the same functions run on a rank's slice of the coefficient axis.
"""

import math

import torch

# Eq. 7's gate and Eq. 7-9 whole (``D^T (z * alpha)``) are written once, in the kernels' reference; the branch runs
# the latter through `fe_megatron.ops.gated_reconstruction`, fused where a backend has the kernel
from fe_megatron.ops.reference import basis_gate, gated_reconstruction  # noqa: F401


def reconstruct(coefficients: torch.Tensor, dictionary: torch.Tensor) -> torch.Tensor:
    """Eq. 9 (first half): ``e_t = D^T z~_t = sum_j z~_{t,j} d_j``. [..., s] -> [..., d_m]."""
    return torch.matmul(coefficients, dictionary)


def scalar_gate(memory: torch.Tensor, query: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Eq. 14 (the scalar-gate ablation): ``alpha_t = sigmoid(e_t . q_t / sqrt(d))``, one gate per
    position. Returns [..., 1]."""
    return torch.sigmoid((memory * query).sum(-1, keepdim=True) / math.sqrt(hidden_size))


def engram_gate(normed_key: torch.Tensor, normed_query: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """DeepSeek Engram's scalar gate with the sqrt-sign step:
    ``g = <k, h> / sqrt(d)``, ``alpha = sigmoid(sign(g) * sqrt(max(|g|, 1e-6)))``. Returns [..., 1]."""
    score = (normed_key * normed_query).sum(-1, keepdim=True) / math.sqrt(hidden_size)
    return torch.sigmoid(score.abs().clamp_min(1e-6).sqrt() * score.sign())


def l1_per_position(coefficients: torch.Tensor) -> torch.Tensor:
    """The inner term of Eq. 12, ``||z_t||_1`` before gating. [..., s] -> [...]."""
    return coefficients.abs().sum(-1)
