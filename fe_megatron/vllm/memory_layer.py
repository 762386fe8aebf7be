"""`ServedMemory`: one memory branch in vLLM, with each request's look-back in vLLM's state cache.

vLLM keeps per-request state for layers that are not attention (Mamba, short convolutions) in
"Mamba" state slots: a layer declares the shapes and dtypes of its state (`MambaBase`), vLLM gives
each running request a slot, and the layer's metadata says, per step, which slot each request owns
and whether it holds history (``has_initial_states``: False for a request's first chunk and for a
request recomputed after preemption).  A memory branch needs exactly such a state
(`fe_megatron.vllm.request_history`):

* ``ids``    ``[max(1, max_order - 1)]`` int32: the last lookup ids (Eq. 1);
* ``values`` ``[max(1, (K-1) r), output_size]`` in the model's dtype: the last values before the
  refinement's norm (Eq. 10).

The layer takes the metadata of vLLM's short convolution (``SHORT_CONV``: the same per-request
slots and prefill offsets), and computes the branch with the one implementation of
`fe_megatron.memory`; only the request bookkeeping is here.

vLLM internals this relies on (checked with vLLM 0.32 by tests/serving, and at start-up by
`check_vllm_internals`):
`MambaBase` (``get_state_shape``, ``get_state_dtype``, ``mamba_type``, ``kv_cache`` bound by
``bind_kv_cache``), the layer's registration in ``compilation_config.static_forward_context``,
``get_forward_context().attn_metadata[prefix]`` as a `BaseMambaAttentionMetadata` (decode tokens
first, one per request, then the prefills with ``query_start_loc_p``, ``state_indices_tensor_p``,
``has_initial_states_p``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

import vllm
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata

from fe_megatron.vllm import request_history
from fe_megatron.vllm.request_history import RequestBatch, state_shapes

ID_DTYPE = torch.int32
TESTED_VLLM = "0.32"  # the vLLM releases whose internals this file was checked against (tests/serving)
METADATA_FIELDS = ("num_prefills", "num_decode_tokens", "query_start_loc_p", "state_indices_tensor_p",
                   "state_indices_tensor_d", "has_initial_states_p")


def check_vllm_internals() -> None:
    """Refuse to start, naming what changed, on a vLLM whose state-cache contract this layer does not know:
    an upgrade that renames these fails here, not mid-request."""
    fields = {field.name for field in dataclasses.fields(ShortConvAttentionMetadata)}
    missing = [name for name in METADATA_FIELDS if name not in fields]
    missing += [f"MambaBase.{name}" for name in ("bind_kv_cache", "get_kv_cache_spec") if not hasattr(MambaBase, name)]
    if missing:
        raise RuntimeError(f"vLLM {vllm.__version__} no longer has {missing}, which fe_megatron's served memory "
                           f"reads (fe_megatron/vllm/memory_layer.py, checked with vLLM {TESTED_VLLM}); install a "
                           "tested vLLM (requirements/serve.txt) or update the adapter")


def state_dtypes(model_dtype: torch.dtype) -> tuple:
    """The dtypes of one request's state: ids as int32 (first, so that every view is aligned), values in
    the model's dtype."""
    return ID_DTYPE, model_dtype


class ServedMemory(nn.Module, MambaBase):
    """The memory branch ``branch`` (a `fe_megatron.memory.MemoryBranch`) of one layer, served.

    ``forward(hidden_states [N, hidden], token_ids [N])`` returns the branch's output ``m`` ``[N,
    output_size]`` for the scheduled tokens of every request (Eq. 10), reading and advancing each
    request's look-back.  The branch's parameters are ``branch.*`` here; the model's weight loader maps
    the Hugging Face names (``layers.N.memory.tables.weight``) onto them."""

    def __init__(self, branch, model_dtype: torch.dtype, prefix: str):
        super().__init__()
        self.branch = branch
        self.model_dtype = model_dtype
        self.prefix = prefix
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix!r}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    # ------------------------------------------------------------------ vLLM's state contract
    def get_state_shape(self):
        return state_shapes(self.branch.config)

    def get_state_dtype(self):
        return state_dtypes(self.model_dtype)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        branch = self.branch
        if metadata is None:  # vLLM's profiling run: no requests, only the cost of every operation
            memory_out, _ = branch(hidden_states.unsqueeze(0), token_ids.unsqueeze(0))
            return memory_out.squeeze(0)
        batch = _step_batch(metadata, hidden_states.device)
        count = batch.num_tokens
        if count == 0:
            return hidden_states.new_zeros(hidden_states.shape[0], branch.config.output_size)
        ids_state, values_state = self.kv_cache
        addresses = request_history.addresses(branch, token_ids[:count], batch, ids_state)
        hidden = hidden_states[:count].unsqueeze(0)
        rows = branch.lookup(hidden, None, branch.start_lookup(addresses.unsqueeze(0), hidden.device))
        values = branch.values(hidden, rows).squeeze(0)  # Eq. 7-9 (FactorEngram) or Engram's gate
        refined = request_history.refine(branch, values, batch, values_state)  # Eq. 10
        if count == hidden_states.shape[0]:
            return refined
        out = hidden_states.new_zeros(hidden_states.shape[0], branch.config.output_size)  # padding: no request
        out[:count] = refined
        return out


_LAST_STEP: list = [None, None]  # (metadata, its RequestBatch): every memory layer of a step reads the same metadata


def _step_batch(metadata, device) -> RequestBatch:
    """`_request_batch`, read once per step: the memory layers of one step share vLLM's metadata object (one state
    group), and the cache holds that object, so a later step's metadata is never taken for it."""
    if _LAST_STEP[0] is not metadata:
        _LAST_STEP[:] = metadata, _request_batch(metadata, device)
    return _LAST_STEP[1]


def _request_batch(metadata, device) -> RequestBatch:
    """The requests of this step from vLLM's metadata: the decodes (one token each) first, then the
    prefills (whole prompts or chunks of them)."""
    num_decodes, num_prefills = metadata.num_decode_tokens, metadata.num_prefills
    decode_slots = None
    if num_decodes:
        decode_slots = metadata.state_indices_tensor_d
        decode_slots = (decode_slots[:, 0] if decode_slots.dim() > 1 else decode_slots)[:num_decodes].long()
        if not num_prefills:  # the steady state: decodes only
            return RequestBatch.decodes(decode_slots.to(device))
    lengths, slots, has_history = [], [], []
    if num_decodes:
        lengths.append(torch.ones(num_decodes, dtype=torch.int64))
        slots.append(decode_slots.cpu())
        has_history.append(torch.ones(num_decodes, dtype=torch.bool))  # a decode continues its request
    if num_prefills:
        starts = metadata.query_start_loc_p.long().cpu()
        lengths.append(starts[1:] - starts[:-1])
        slots.append(metadata.state_indices_tensor_p[:num_prefills].long().cpu())
        has_history.append(metadata.has_initial_states_p[:num_prefills].bool().cpu())
    if not lengths:  # a step with no request of this layer's group
        lengths, slots, has_history = [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int64)], \
            [torch.zeros(0, dtype=torch.bool)]
    return RequestBatch(torch.cat(lengths).to(device), torch.cat(slots).to(device),
                        torch.cat(has_history).to(device))
