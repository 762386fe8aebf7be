"""The equations of the memory branch as functions of tensors.

Both the single-process modules (`fe_megatron.memory`) and the tensor-parallel
Megatron modules call these, so each equation is written exactly once.
"""

import math

import torch


def basis_gate(query: torch.Tensor, dictionary: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Eq. 7: ``alpha_t = sigmoid(D q_t / sqrt(d))``, one gate per dictionary row.

    query: [..., d_m]; dictionary: [s, d_m] (or a row shard of it). Returns [..., s].
    """
    return torch.sigmoid(torch.matmul(query, dictionary.t()) / math.sqrt(hidden_size))


def reconstruct(coefficients: torch.Tensor, dictionary: torch.Tensor) -> torch.Tensor:
    """Eq. 9 (first half): ``e_t = D^T z~_t = sum_j z~_{t,j} d_j``. [..., s] -> [..., d_m]."""
    return torch.matmul(coefficients, dictionary)


def scalar_gate(memory: torch.Tensor, query: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Eq. 11: ``alpha_t = sigmoid(e_t . q_t / sqrt(d))``, one gate per position. Returns [..., 1]."""
    return torch.sigmoid((memory * query).sum(-1, keepdim=True) / math.sqrt(hidden_size))


def engram_gate(normed_key: torch.Tensor, normed_query: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """DeepSeek Engram's scalar gate with the sqrt-sign step:
    ``g = <k, h> / sqrt(d)``, ``alpha = sigmoid(sign(g) * sqrt(max(|g|, 1e-6)))``. Returns [..., 1]."""
    score = (normed_key * normed_query).sum(-1, keepdim=True) / math.sqrt(hidden_size)
    return torch.sigmoid(score.abs().clamp_min(1e-6).sqrt() * score.sign())


def l1_per_position(coefficients: torch.Tensor) -> torch.Tensor:
    """The inner term of Eq. 12, ``||z_t||_1`` before gating. [..., s] -> [...]."""
    return coefficients.abs().sum(-1)
