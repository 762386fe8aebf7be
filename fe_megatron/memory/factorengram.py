"""FactorEngram: factorized n-gram memory with basis-level gating (Sec. 3, Eq. 6-10; Eq. 14)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from fe_megatron import ops
from fe_megatron.config import MemoryConfig
from fe_megatron.memory import functional as FM
from fe_megatron.memory.branch import MemoryBranch, Normal
from fe_megatron.memory.decoding import Decoding
from fe_megatron.tables.store import StartedLookup
from fe_megatron.memory.parallel_hooks import SINGLE_PROCESS, ParallelHooks


class FactorEngram(MemoryBranch):
    """One FactorEngram memory branch for insertion layer ``layer_index`` (one of ``config.layers``).

    ``forward(hidden_states [B, T, d], token_ids [B, T])`` returns ``(m, l1)``: the memory output
    ``m`` [B, T, output_size] (Eq. 10) that the caller adds to the residual stream (Eq. 11), and
    the per-position L1 norm of the coefficients ``||z_t||_1`` [B, T] (Eq. 12's inner term; None in a server's step,
    which has no loss).
    A started ``lookup`` (``start_lookup(addresses(token_ids))``, `fe_megatron.memory.inputs`) may replace
    ``token_ids``.

    Every parallel layout runs this class: ``parallel`` (`ParallelHooks`) supplies the
    communication, and parameters hold this rank's slice per `fe_megatron.memory.sharding`.
    Under tensor parallelism ``l1`` is this rank's share (the shares sum to the full norm).

    Parameters (global shapes; initialization in docs/method.md):
      tables.weight  [rows, s_b]          z-coefficients, N(0, table_init_std^2).
      dictionary     [branches, s_b, d_m] D viewed per branch, N(0, 1/s).
      query_proj     [d_m, d]             Q^T, N(0, init_std); scale-free because RMSNorm follows.
      query_norm     [d_m]                ones.
      value_proj     [out, d_m]           V, zeros: the branch starts as an exact identity (m = 0).
      conv.*                              ShortConv: norm ones, weight zeros (as in Engram).
    """

    kind = "factorengram"

    def __init__(self, config: MemoryConfig, layer_index: int, parallel: Optional[ParallelHooks] = None,
                 initialize: bool = True):
        super().__init__(config, layer_index, parallel, initialize)
        dictionary_shape = (config.num_branches, config.branch_width, config.memory_dim)
        self.dictionary = nn.Parameter(torch.empty(self.local_shape("dictionary", dictionary_shape)))
        if config.gate != "none":  # gate='none' reads no hidden state and has no query path
            self.query_proj = nn.Linear(config.hidden_size, config.memory_dim, bias=False)
            self.query_norm = nn.RMSNorm(config.memory_dim, eps=config.norm_eps)
        self.value_proj = nn.Linear(config.memory_dim, config.output_size, bias=False)
        if initialize:
            self.reset_parameters()

    def initial_values(self) -> dict:
        cfg = self.config
        values = {"tables.weight": Normal(cfg.table_init_std), "dictionary": Normal(1.0 / math.sqrt(cfg.coeff_width)),
                  "value_proj.weight": 0.0, "conv.norm.weight": 1.0, "conv.weight": 0.0}
        if cfg.gate != "none":
            values.update({"query_proj.weight": Normal(cfg.init_std), "query_norm.weight": 1.0})
        return values

    def query(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Eq. 7 (first half): ``q_t = RMSNorm(Q^T h_t)``."""
        return self.query_norm(self.query_proj(hidden_states))

    def forward(self, hidden_states: torch.Tensor, token_ids: Optional[torch.Tensor] = None, *,
                lookup: Optional[StartedLookup] = None, decoding: Optional[Decoding] = None):
        coefficients = self.lookup(hidden_states, token_ids, lookup, decoding)  # z_t, Eq. 6
        l1 = self.sparsity_term(coefficients, decoding)  # Eq. 12
        return self.refine(self.values(hidden_states, coefficients), decoding), l1  # m_t, Eq. 10

    def values(self, hidden_states: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        """``v_t = V e_t`` (Eq. 9) of every position from its coefficients ``z_t`` (Eq. 6): position by
        position, so a server may compute it for a batch of requests at once (`fe_megatron.vllm`)."""
        if self._values_in_one_call():  # Eq. 7-9 and V: one kernel call (fe_megatron.ops.basis_memory_values)
            values = ops.basis_memory_values(
                hidden_states.flatten(0, -2), coefficients.flatten(0, -2), self.query_proj.weight,
                self.query_norm.weight, self.query_norm.eps, self.dictionary.flatten(0, 1), self.value_proj.weight,
                self.config.hidden_size)
            return values.view(*hidden_states.shape[:-1], values.shape[-1])
        return self.value_proj(self.gated_memory(hidden_states, coefficients))  # e_t: Eq. 7-9 (or Eq. 14)

    def _values_in_one_call(self) -> bool:
        """Whether `values` runs as one call: the basis gate in one process (no communication between the products),
        with nothing to differentiate (``generate``, a server), and plain modules (no hook, no replaced layer), whose
        parameters are all there is to their forward."""
        if self.config.gate != "basis" or self.parallel is not SINGLE_PROCESS or torch.is_grad_enabled() \
                or not ops.fused_branch_enabled():
            return False
        modules = ((self.query_proj, nn.Linear), (self.query_norm, nn.RMSNorm), (self.value_proj, nn.Linear))
        return all(type(module) is kind and not (module._forward_hooks or module._forward_pre_hooks)
                   for module, kind in modules) and self.query_norm.eps is not None

    def gated_memory(self, hidden_states: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        """``e_t``: Eq. 7-9 for the basis gate, Eq. 14 for the scalar gate, ``D^T z_t`` for none."""
        gate, hidden_size, parallel = self.config.gate, self.config.hidden_size, self.parallel
        dictionary = self.dictionary.flatten(0, 1)  # [s (this rank's rows), d_m]
        if gate == "basis":  # Eq. 7-9 in one kernel where the backend has it (fe_megatron.ops.gated_reconstruction)
            query = parallel.replicate_for_partial_use(self.query(hidden_states))
            return parallel.sum_partial_results(ops.gated_reconstruction(coefficients, query, dictionary, hidden_size))
        memory = parallel.sum_partial_results(FM.reconstruct(coefficients, dictionary))
        if gate == "scalar":
            return FM.scalar_gate(memory, self.query(hidden_states), hidden_size) * memory  # Eq. 14
        return memory  # gate == "none"
