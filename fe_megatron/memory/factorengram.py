"""FactorEngram: factorized n-gram memory with basis-level gating (Sec. 3, Eq. 6-12)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from fe_megatron.config import MemoryConfig
from fe_megatron.memory import functional as FM
from fe_megatron.memory.short_conv import ShortConv
from fe_megatron.memory.tables import CoefficientTables
from fe_megatron.ngram import NgramHasher


def check_memory_inputs(config: MemoryConfig, hidden_states: torch.Tensor, token_ids, indices) -> None:
    """Shape and dtype checks shared by the memory modules (ids are range-checked by the hasher)."""
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != config.hidden_size:
        raise ValueError(f"hidden_states must have shape [batch, seq, hidden_size={config.hidden_size}], "
                         f"got {tuple(hidden_states.shape)}")
    if not hidden_states.is_floating_point():
        raise TypeError(f"hidden_states must be a floating-point tensor, got dtype {hidden_states.dtype}")
    if (token_ids is None) == (indices is None):
        raise ValueError("pass exactly one of token_ids ([batch, seq] ids) or indices (precomputed row indices)")
    ids = token_ids if token_ids is not None else indices
    if isinstance(ids, torch.Tensor) and tuple(ids.shape[:2]) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"token ids / indices of shape {tuple(ids.shape)} do not match hidden_states "
                         f"[batch, seq] = {tuple(hidden_states.shape[:2])}")


class FactorEngram(nn.Module):
    """One FactorEngram memory branch for insertion layer ``layer_number`` (one of ``config.layers``).

    ``forward(hidden_states [B, T, d], token_ids [B, T])`` returns ``(m, l1)``: the memory
    output ``m`` [B, T, output_size] to add to the residual stream (Eq. 10, 11) and the
    per-position L1 norm of the coefficients ``||z_t||_1`` [B, T] (Eq. 12's inner term).

    Parameters and their initialization (see docs/method.md):
      tables.weight  [rows, s_b]  z-coefficients, N(0, 1) as an nn.Embedding (Engram).
      dictionary     [s, d_m]     D, N(0, 1/s): reconstruction with gates ~0.5 has O(1) entries.
      query_proj     [d_m, d]     Q^T, N(0, init_std); scale-free because RMSNorm follows.
      query_norm     [d_m]        ones.
      value_proj     [out, d_m]   V, zeros: the branch starts as an exact identity (m = 0).
      conv.*                      ShortConv: norm ones, weight zeros (as in Engram).
    """

    def __init__(self, config: MemoryConfig, layer_number: int):
        super().__init__()
        if config.representation != "factorized":
            raise ValueError(f"FactorEngram needs representation='factorized', got {config.representation!r}; "
                             "use fe_megatron.memory.Engram (or build_memory) for dense tables")
        self.config = config
        self.layer_number = layer_number
        self.hasher = NgramHasher(config, layer_number)
        self.tables = CoefficientTables(self.hasher.total_rows(layer_number), config.branch_width)
        self.dictionary = nn.Parameter(torch.empty(config.coeff_width, config.memory_dim))
        if config.gate != "none":  # gate='none' reads no hidden state and has no query path
            self.query_proj = nn.Linear(config.hidden_size, config.memory_dim, bias=False)
            self.query_norm = nn.RMSNorm(config.memory_dim, eps=config.norm_eps)
        self.value_proj = nn.Linear(config.memory_dim, config.output_size, bias=False)
        self.conv = ShortConv(config.output_size, config.conv_kernel_size, config.conv_dilation, config.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        cfg = self.config
        self.tables.reset_parameters()
        nn.init.normal_(self.dictionary, std=1.0 / math.sqrt(cfg.coeff_width))
        if cfg.gate != "none":
            nn.init.normal_(self.query_proj.weight, std=cfg.init_std)
        nn.init.zeros_(self.value_proj.weight)  # the branch starts as an exact identity

    def query(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Eq. 7: ``q_t = RMSNorm(Q^T h_t)``."""
        return self.query_norm(self.query_proj(hidden_states))

    def forward(self, hidden_states: torch.Tensor, token_ids: Optional[torch.Tensor] = None, *,
                indices: Optional[torch.Tensor] = None):
        check_memory_inputs(self.config, hidden_states, token_ids, indices)
        if indices is None:
            indices = self.hasher.indices(token_ids)
        coefficients = self.tables(indices).to(hidden_states.dtype)  # z_t, Eq. 6
        l1 = FM.l1_per_position(coefficients)  # Eq. 12
        memory = self._gated_memory(hidden_states, coefficients)  # e_t, Eq. 7-9 / 11
        values = self.value_proj(memory)  # v_t, Eq. 9
        return values + self.conv(values), l1  # m_t, Eq. 10

    def _gated_memory(self, hidden_states: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        gate, hidden_size = self.config.gate, self.config.hidden_size
        if gate == "basis":
            alpha = FM.basis_gate(self.query(hidden_states), self.dictionary, hidden_size)  # Eq. 7
            return FM.reconstruct(coefficients * alpha, self.dictionary)  # Eq. 8, 9
        memory = FM.reconstruct(coefficients, self.dictionary)
        if gate == "scalar":
            return FM.scalar_gate(memory, self.query(hidden_states), hidden_size) * memory  # Eq. 11
        return memory  # gate == "none"
