"""The memory in vLLM: one router that hashes every memory layer's addresses once per step, and `ServedMemory`,
one memory branch with each request's look-back in vLLM's state cache. Both run as vLLM custom ops, as vLLM's
own ``short_conv`` does, so vLLM compiles the rest of the model around them (and a GPU captures piecewise CUDA
graphs between them, never a full graph over them: `serving_config.piecewise_graphs_on_a_gpu`).

vLLM keeps per-request state for layers that are not attention (Mamba, short convolutions) in "Mamba" state
slots: a layer declares the shapes and dtypes of its state (`MambaBase`), vLLM gives each running request a
slot, and the layer's metadata says, per step, which slot each request owns, whether it holds history
(``has_initial_states``: False for a request's first chunk and for a request recomputed after preemption), and,
with speculative decoding, how many of the last step's drafts were accepted. A memory layer's state is its
look-back (`fe_megatron.memory.look_back`):

* ``ids``    ``[max(1, max_order - 1) + k, 1]`` int32: the last lookup ids (Eq. 1);
* ``values`` ``[max(1, (K-1) r) + k, output_size]`` in the model's dtype: the last values before the
  refinement's norm (Eq. 10);

``k`` speculative tokens per step. The router keeps the ids in the first memory layer's state (one ring for
every layer: the ids are the same); each layer keeps its values. The layout is that of vLLM's convolution
states, so with prefix caching vLLM's align mode stores and copies it at block boundaries (`STATE_COPY_FUNCS`).

The layers take the metadata of vLLM's short convolution (``SHORT_CONV``: the same per-request slots and
prefill offsets), read once per step (`step_batch`), and compute the branch with the one forward of
`fe_megatron.memory`; only the request bookkeeping is here.

vLLM internals this relies on (checked with vLLM 0.32 by tests/serving, and at start-up by
`check_vllm_internals`): `MambaBase` (``get_state_shape``, ``get_state_dtype``, ``mamba_type``, ``kv_cache``
bound by ``bind_kv_cache``), the layer's registration in ``compilation_config.static_forward_context``,
``get_forward_context().attn_metadata[prefix]`` as a `BaseMambaAttentionMetadata` (decode tokens first, then
the prefills with ``query_start_loc_p``, ``state_indices_tensor_p``, ``has_initial_states_p``; decodes of
several tokens with ``query_start_loc_d`` and ``num_accepted_tokens``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

import vllm
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, is_conv_state_dim_first
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata

from fe_megatron.memory.look_back import RequestBatch, ServedStep, addresses, state_shapes
from fe_megatron.ngram import NgramHasher

ID_DTYPE = torch.int32
TESTED_VLLM = "0.32"  # the vLLM releases whose internals this file was checked against (tests/serving)
METADATA_FIELDS = ("num_prefills", "num_decodes", "num_decode_tokens", "num_prefill_tokens", "query_start_loc_p",
                   "query_start_loc_d", "state_indices_tensor_p", "state_indices_tensor_d", "has_initial_states_p",
                   "num_accepted_tokens")
# the ops vLLM's compiler must leave whole (and split CUDA graphs at): what they do depends on each step's requests
MEMORY_OPS = ("vllm::fe_memory_addresses", "vllm::fe_memory")
# how vLLM's align mode copies a state at a block boundary (prefix caching): both of a memory layer's states have
# the layout of a convolution state, [slot, position, ...] read from ``num_accepted_tokens - 1``
STATE_COPY_FUNCS = (get_conv_copy_spec, get_conv_copy_spec)


def check_vllm_internals() -> None:
    """Refuse to start, naming what changed, on a vLLM whose state-cache contract this layer does not know:
    an upgrade that renames these fails here, not mid-request."""
    fields = {field.name for field in dataclasses.fields(ShortConvAttentionMetadata)}
    missing = [name for name in METADATA_FIELDS if name not in fields]
    missing += [f"MambaBase.{name}" for name in ("bind_kv_cache", "get_kv_cache_spec") if not hasattr(MambaBase, name)]
    if is_conv_state_dim_first():
        missing.append("convolution states laid out [slot, position, ...] (this vLLM lays them out dim first)")
    if missing:
        raise RuntimeError(f"vLLM {vllm.__version__} no longer has {missing}, which fe_megatron's served memory "
                           f"reads (fe_megatron/vllm/memory_layer.py, checked with vLLM {TESTED_VLLM}); install a "
                           "tested vLLM (requirements/serve.txt) or update the adapter")


def state_dtypes(model_dtype: torch.dtype) -> tuple:
    """The dtypes of one request's state: ids as int32 (first, so that every view is aligned), values in
    the model's dtype."""
    return ID_DTYPE, model_dtype


def _register(prefix: str, layer: nn.Module) -> None:
    """Enter ``layer`` in vLLM's forward context under ``prefix``, where its custom op finds it."""
    context = get_current_vllm_config().compilation_config.static_forward_context
    if prefix in context:
        raise ValueError(f"duplicate layer name {prefix!r}")
    context[prefix] = layer


def step_requests(prefix: str, device) -> Optional[RequestBatch]:
    """This step's requests (`request_batch`, read once per step) from the metadata of the layer ``prefix``; None in
    vLLM's profiling run, which has no requests, only the cost of every operation."""
    metadata = get_forward_context().attn_metadata
    metadata = metadata.get(prefix) if isinstance(metadata, dict) else None
    return None if metadata is None else step_batch(metadata, device)


class ServedMemoryRouter(nn.Module):
    """Every memory layer's addresses (Eq. 1) for the step's tokens, hashed in one launch with one look-back of
    ids (kept in the state of the first memory layer, ``ids_holder``): ``forward(token_ids [N])`` returns ``[N,
    branches of every layer]``, layer by layer (`slices`)."""

    def __init__(self, memory_config, ids_holder: str):
        super().__init__()
        self.hasher = NgramHasher(memory_config)
        self.ids_holder = ids_holder
        self.prefix = f"{ids_holder}.router"
        sizes = [len(layout.orders) for layout in self.hasher.layouts]
        starts = [sum(sizes[:index]) for index in range(len(sizes))]
        self.slices = {layer: (start, start + size) for layer, start, size in zip(self.hasher.layers, starts, sizes)}
        self.num_branches = sum(sizes)
        _register(self.prefix, self)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(token_ids.shape[0], self.num_branches, dtype=torch.int64, device=token_ids.device)
        torch.ops.vllm.fe_memory_addresses(token_ids, out, self.prefix)
        return out

    def forward_native(self, token_ids: torch.Tensor, out: torch.Tensor) -> None:
        batch = step_requests(self.ids_holder, token_ids.device)
        if batch is None:  # vLLM's profiling run
            out.copy_(self.hasher.indices(token_ids.unsqueeze(0)).squeeze(0))
            return
        count = batch.num_tokens
        out[count:] = 0  # padding (every position, in a step with no request of this state group)
        if count:
            holder = get_forward_context().no_compile_layers[self.ids_holder]
            ids = self.hasher.lookup_ids(token_ids[:count].unsqueeze(0)).squeeze(0)  # checks the ids' range
            out[:count] = addresses(self.hasher, ids, batch, holder.kv_cache[0][..., 0])


class ServedMemory(nn.Module, MambaBase):
    """The memory branch ``branch`` (a `fe_megatron.memory.MemoryBranch`) of one layer, served.

    ``forward(hidden_states [N, hidden], addresses [N, branches])`` returns the branch's output ``m`` ``[N,
    output_size]`` for the scheduled tokens of every request (Eq. 10), reading and advancing each request's
    look-back of values.  The branch's parameters are ``branch.*`` here; the model's weight loader maps the
    Hugging Face names (``layers.N.memory.tables.weight``) onto them."""

    def __init__(self, branch, model_dtype: torch.dtype, prefix: str):
        super().__init__()
        self.branch = branch
        self.model_dtype = model_dtype
        self.prefix = prefix
        self.speculative_tokens = get_current_vllm_config().num_speculative_tokens
        _register(prefix, self)
        self.kv_cache = (torch.tensor([]),)

    # ------------------------------------------------------------------ vLLM's state contract
    def get_state_shape(self):
        return state_shapes(self.branch.config, self.speculative_tokens)

    def get_state_dtype(self):
        return state_dtypes(self.model_dtype)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, addresses: torch.Tensor) -> torch.Tensor:
        out = hidden_states.new_empty(hidden_states.shape[0], self.branch.config.output_size)
        torch.ops.vllm.fe_memory(hidden_states, addresses, out, self.prefix)
        return out

    def forward_native(self, hidden_states: torch.Tensor, addresses: torch.Tensor, out: torch.Tensor) -> None:
        branch, batch = self.branch, step_requests(self.prefix, hidden_states.device)
        if batch is None:  # vLLM's profiling run
            lookup = branch.start_lookup(addresses.unsqueeze(0), hidden_states.device)
            out.copy_(branch(hidden_states.unsqueeze(0), lookup=lookup)[0].squeeze(0))
            return
        count = batch.num_tokens
        out[count:] = 0  # padding (every position, in a step with no request of this state group)
        if count:
            hidden = hidden_states[:count].unsqueeze(0)
            lookup = branch.start_lookup(addresses[:count].unsqueeze(0), hidden.device)
            memory_out, _ = branch(hidden, lookup=lookup, decoding=ServedStep(batch, self.kv_cache[1]))  # Eq. 6-10
            out[:count] = memory_out.squeeze(0)


def _served_memory_addresses(token_ids: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].forward_native(token_ids, out)


def _served_memory(hidden_states: torch.Tensor, addresses: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].forward_native(hidden_states, addresses, out)


direct_register_custom_op(op_name="fe_memory_addresses", op_func=_served_memory_addresses, mutates_args=["out"])
direct_register_custom_op(op_name="fe_memory", op_func=_served_memory, mutates_args=["out"])


_LAST_STEP: list = [None, None]  # (metadata, its RequestBatch): the memory layers of a group read one metadata


def step_batch(metadata, device) -> RequestBatch:
    """`request_batch`, read once per step: the memory layers of one state group share vLLM's metadata object, and
    the cache holds that object, so a later step's metadata is never taken for it."""
    if _LAST_STEP[0] is not metadata:
        _LAST_STEP[:] = metadata, request_batch(metadata, device)
    return _LAST_STEP[1]


def _first_column(slots: torch.Tensor, count: int) -> torch.Tensor:
    return (slots[:, 0] if slots.dim() > 1 else slots)[:count].long()


def request_batch(metadata, device) -> RequestBatch:
    """The requests of this step from vLLM's metadata: the decodes first (one token each, or, with speculative
    decoding, the last token and its drafts), then the prefills (whole prompts or chunks of them)."""
    num_decodes, num_prefills = metadata.num_decodes, metadata.num_prefills
    num_tokens = metadata.num_decode_tokens + metadata.num_prefill_tokens
    speculative = metadata.num_accepted_tokens is not None and num_decodes > 0
    if num_decodes and not num_prefills and not speculative:  # the steady state: one new token per request
        slots = _first_column(metadata.state_indices_tensor_d, num_decodes).to(device)
        return RequestBatch(torch.ones(num_decodes, dtype=torch.int64, device=device), slots,
                            torch.ones(num_decodes, dtype=torch.bool, device=device), num_decodes, uniform=1,
                            all_continue=True)
    lengths, slots, has_history, read_from, drafts = [], [], [], [], []
    if num_decodes:
        if speculative:
            starts = metadata.query_start_loc_d[:num_decodes + 1].long().to(device)
            lengths.append(starts[1:] - starts[:-1])
            read_from.append(metadata.num_accepted_tokens[:num_decodes].long().to(device) - 1)
        else:
            lengths.append(torch.ones(num_decodes, dtype=torch.int64, device=device))
            read_from.append(torch.zeros(num_decodes, dtype=torch.int64, device=device))
        slots.append(_first_column(metadata.state_indices_tensor_d, num_decodes).to(device))
        has_history.append(torch.ones(num_decodes, dtype=torch.bool, device=device))  # a decode continues
        drafts.append(torch.full((num_decodes,), speculative, dtype=torch.bool, device=device))
    if num_prefills:
        starts = metadata.query_start_loc_p.long().to(device)
        lengths.append(starts[1:] - starts[:-1])
        slots.append(_first_column(metadata.state_indices_tensor_p, num_prefills).to(device))
        has_history.append(metadata.has_initial_states_p[:num_prefills].bool().to(device))
        read_from.append(torch.zeros(num_prefills, dtype=torch.int64, device=device))
        drafts.append(torch.zeros(num_prefills, dtype=torch.bool, device=device))
    if not lengths:  # a step with no request of this layer's group
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return RequestBatch(empty, empty, empty.bool(), 0)
    return RequestBatch(torch.cat(lengths), torch.cat(slots), torch.cat(has_history), num_tokens,
                        read_from=torch.cat(read_from) if speculative else None,
                        speculative=torch.cat(drafts) if speculative else None)
