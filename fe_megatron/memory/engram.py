"""Engram: DeepSeek's dense hashed n-gram memory with one scalar gate (the paper's baseline)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from fe_megatron.config import MemoryConfig
from fe_megatron.memory import functional as FM
from fe_megatron.memory.branch import MemoryBranch, Normal
from fe_megatron.memory.decoding import Decoding
from fe_megatron.tables.store import StartedLookup
from fe_megatron.memory.parallel_hooks import ParallelHooks


class BranchLinear(nn.Module):
    """A bias-free linear map of the concatenated branch embeddings, its weight viewed per branch:
    ``[out, branches, s_b]`` (nn.Linear's ``[out, s]``), so that a tensor-parallel rank holds the
    columns that meet its own table columns (axis 2)."""

    def __init__(self, out_features: int, num_branches: int, branch_width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, num_branches, branch_width))

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return torch.matmul(embeddings, self.weight.flatten(1).t())


class Engram(MemoryBranch):
    """Dense Engram branch, following DeepSeek's public demo with one residual stream:

        e_t = Concat_b E_b[phi_b(g_t)]                      (dense embeddings, width s; Eq. 6's lookup)
        k_t = RMSNorm(W_k e_t),  h'_t = RMSNorm(h_t)
        g   = <k_t, h'_t> / sqrt(d);  alpha_t = sigmoid(sign(g) sqrt(|g|))
        v_t = alpha_t W_v e_t;   m_t = v_t + ShortConv(v)_t  (Eq. 10)

    ``gate='none'`` drops the key path (alpha = 1).  Same call contract as `FactorEngram`; the
    returned L1 term is ``||e_t||_1`` (zero weight in the Engram presets).  Linear layers have no
    bias (Megatron convention) where the demo's nn.Linear has one.

    Parameters (global shapes): tables.weight [rows, s_b] N(0, table_init_std^2); key_proj
    [d, branches, s_b] N(0, init_std); key_norm, query_norm ones; value_proj [out, branches, s_b]
    zeros (the branch starts as an exact identity, see docs/method.md); conv.* (weight zeros).
    """

    kind = "engram"

    def __init__(self, config: MemoryConfig, layer_index: int, parallel: Optional[ParallelHooks] = None,
                 initialize: bool = True):
        super().__init__(config, layer_index, parallel, initialize)
        branches, width = config.num_branches, config.branch_width
        if config.gate == "scalar":
            self.key_proj = BranchLinear(*self.local_shape("key_proj.weight", (config.hidden_size, branches, width)))
            self.key_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
            self.query_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.value_proj = BranchLinear(*self.local_shape("value_proj.weight", (config.output_size, branches, width)))
        if initialize:
            self.reset_parameters()

    def initial_values(self) -> dict:
        cfg = self.config
        values = {"tables.weight": Normal(cfg.table_init_std), "value_proj.weight": 0.0, "conv.norm.weight": 1.0,
                  "conv.weight": 0.0}
        if cfg.gate == "scalar":
            values.update({"key_proj.weight": Normal(cfg.init_std), "key_norm.weight": 1.0, "query_norm.weight": 1.0})
        return values

    def forward(self, hidden_states: torch.Tensor, token_ids: Optional[torch.Tensor] = None, *,
                lookup: Optional[StartedLookup] = None, decoding: Optional[Decoding] = None):
        embeddings = self.lookup(hidden_states, token_ids, lookup, decoding)
        return self.refine(self.values(hidden_states, embeddings), decoding), self.sparsity_term(embeddings, decoding)

    def values(self, hidden_states: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """``v_t = alpha_t W_v e_t`` of every position from its embeddings ``e_t``: position by position,
        so a server may compute it for a batch of requests at once (`fe_megatron.vllm`)."""
        values = self.parallel.sum_partial_results(self.value_proj(embeddings))
        if self.config.gate == "scalar":
            key = self.key_norm(self.parallel.sum_partial_results(self.key_proj(embeddings)))
            values = FM.engram_gate(key, self.query_norm(hidden_states), self.config.hidden_size) * values
        return values
