"""Engram: DeepSeek's dense hashed n-gram memory with one scalar gate (the paper's baseline)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from fe_megatron.config import MemoryConfig
from fe_megatron.memory import functional as FM
from fe_megatron.memory.factorengram import check_memory_inputs
from fe_megatron.memory.short_conv import ShortConv
from fe_megatron.memory.tables import CoefficientTables
from fe_megatron.ngram import NgramHasher


class Engram(nn.Module):
    """Dense Engram branch, following DeepSeek's public demo with one residual stream:

        e_t = Concat_b E_b[phi_b(g_t)]                      (dense embeddings, width s)
        k_t = RMSNorm(W_k e_t),  h'_t = RMSNorm(h_t)
        g   = <k_t, h'_t> / sqrt(d);  alpha_t = sigmoid(sign(g) sqrt(|g|))
        v_t = alpha_t W_v e_t;   m_t = v_t + ShortConv(v)_t

    ``gate='none'`` drops the key path (alpha = 1).  Same call contract as `FactorEngram`;
    the returned L1 term is ``||e_t||_1`` (zero weight in the Engram presets).
    Linear layers have no bias (Megatron convention) where the demo's nn.Linear has one.

    Parameters: tables.weight N(0, 1); key_proj N(0, init_std); key_norm, query_norm ones;
    value_proj zeros (the branch starts as an exact identity, see docs/method.md); conv.* (weight zeros).
    """

    def __init__(self, config: MemoryConfig, layer_number: int):
        super().__init__()
        if config.representation != "dense":
            raise ValueError(f"Engram needs representation='dense', got {config.representation!r}")
        self.config = config
        self.layer_number = layer_number
        self.hasher = NgramHasher(config, layer_number)
        self.tables = CoefficientTables(self.hasher.total_rows(layer_number), config.branch_width)
        if config.gate == "scalar":
            self.key_proj = nn.Linear(config.coeff_width, config.hidden_size, bias=False)
            self.key_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
            self.query_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.value_proj = nn.Linear(config.coeff_width, config.output_size, bias=False)
        self.conv = ShortConv(config.output_size, config.conv_kernel_size, config.conv_dilation, config.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        cfg = self.config
        self.tables.reset_parameters()
        if cfg.gate == "scalar":
            nn.init.normal_(self.key_proj.weight, std=cfg.init_std)
        nn.init.zeros_(self.value_proj.weight)  # the branch starts as an exact identity

    def forward(self, hidden_states: torch.Tensor, token_ids: Optional[torch.Tensor] = None, *,
                indices: Optional[torch.Tensor] = None):
        check_memory_inputs(self.config, hidden_states, token_ids, indices)
        if indices is None:
            indices = self.hasher.indices(token_ids)
        embeddings = self.tables(indices).to(hidden_states.dtype)
        values = self.value_proj(embeddings)
        if self.config.gate == "scalar":
            key = self.key_norm(self.key_proj(embeddings))
            values = FM.engram_gate(key, self.query_norm(hidden_states), self.config.hidden_size) * values
        return values + self.conv(values), FM.l1_per_position(embeddings)
