"""`FactorEngramHybridModel`: megatron-core's ``HybridModel`` (0.19 on) with the memory branch before the
attention of chosen attention (``*``) layers.

Layer numbers. `MemoryConfig.layers` counts transformer blocks, as in the paper ("layers 10 and 12 of
24") and in the GPT model: the memory of block ``i`` sits before the attention of the pattern's
``i``-th ``*`` layer (`fe_megatron.hybrid_pattern`: the layer numbers, pipeline stages and
names of a pattern), and hashes as block ``i`` does in the GPT model, so a pattern of ``*-`` pairs is the
GPT model with memory, parameter for parameter (`hybrid_pattern.gpt_name_of`).

The memory's inputs. ``HybridStack.forward`` takes no ``context`` (the argument through which the GPT
model's block hands the memory its token ids), and its full-recompute path passes None for it. So the
model owns the inputs: once per microbatch its forward hashes the token ids, starts the stage's lookups
(`fe_megatron.memory.branch.start_stage_lookups`: one row exchange for every row-sharded layer of the
stage) and hands the result, a `StageMemoryInputs`, to this stage's memory layers for the length of
that forward. A layer reads it in its own forward, so microbatches of an interleaved pipeline schedule
never share one.

Full recompute runs a layer twice: inside the checkpoint's forward (grad disabled), and again in backward,
after later microbatches' forwards may have run. There the model hands the layers the hashed addresses
rather than started lookups (a started lookup is read once), and each memory layer queues the addresses of
every checkpointed forward and takes the oldest in each recomputation: Megatron's schedules run the
backwards of a stage's microbatches in the order of their forwards (one model chunk per stage, as the
memory requires), so the queue hands each recomputation its own microbatch's addresses. The lookup, and
with row-sharded tables its row exchange, runs again there, as in the GPT model.

A memory layer (`MemoryBeforeAttentionLayer`) is megatron-core's attention layer plus the branch: it
adds the branch's output to its input (Eq. 11) and calls ``TransformerLayer``'s public ``forward``. Its
checkpoint is the GPT layer's (`HostsMemory`): the branch's tensors split along the sharding plan's axes,
under ``decoder.layers.<position in the pattern>.memory.``.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron.hasher import MicrobatchHasher
from fe_megatron.hybrid_pattern import memory_positions
from fe_megatron.megatron.memory_layer import build_memory_branch
from fe_megatron.megatron.sparsity import attach_sparsity_loss, pop_stage_sparsity_loss
from fe_megatron.megatron.transformer_layer import HostsMemory
from fe_megatron.memory.branch import start_stage_lookups


@dataclasses.dataclass
class StageMemoryInputs:
    """One microbatch's memory inputs on one pipeline stage: ``{memory layer index: its row indices
    ([s, b, branches]) or the lookup started for them}``."""

    lookups: dict

    def of(self, layer_index: int):
        if layer_index not in self.lookups:
            raise RuntimeError(f"no memory inputs for memory layer {layer_index} in this microbatch (it has "
                               f"{sorted(self.lookups)})")
        return self.lookups[layer_index]


class MemoryBeforeAttentionLayer(HostsMemory, TransformerLayer):
    """A hybrid stack's attention layer with the memory branch before its attention where
    ``memory_positions`` (``{0-based layer: memory layer index}``) names it (see the module docstring)."""

    def __init__(self, config, submodules, *args, memory_config: MemoryConfig, memory_positions: dict,
                 table_sharding: str = "replicated", **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.memory_config = memory_config
        self.memory_index = memory_positions.get(self.layer_number - 1)
        self.memory = None
        if self.memory_index is not None:
            self.memory = build_memory_branch(config, memory_config, self.memory_index, self.tp_group, table_sharding)
        self.tracked_sparsity_loss: list = []
        self.memory_inputs: Optional[StageMemoryInputs] = None  # this microbatch's, set by the model's forward
        # under full recompute: the addresses of checkpointed forwards whose recomputation is still to come
        self.pending_recomputations: collections.deque = collections.deque()

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if self.memory is None:
            return super().forward(hidden_states, *args, **kwargs)
        memory_out, aux_loss = self._memory(hidden_states, self._this_call_s_lookup())
        output, context = super().forward(hidden_states + memory_out, *args, **kwargs)  # Eq. 11
        return attach_sparsity_loss(output, aux_loss), context

    def _this_call_s_lookup(self):
        """The memory inputs of this call: the model's for this forward, or, in a full recompute's
        recomputation (in backward, no model forward running), those its checkpointed forward queued."""
        recomputing_fully = self.config.recompute_granularity == "full" and self.training
        if self.memory_inputs is not None:
            lookup = self.memory_inputs.of(self.memory_index)
            if recomputing_fully and not torch.is_grad_enabled():  # the checkpoint's forward: recomputed later
                self.pending_recomputations.append(lookup)
            return lookup
        if recomputing_fully and torch.is_grad_enabled() and self.pending_recomputations:
            return self.pending_recomputations.popleft()
        raise RuntimeError(f"the memory layer before attention layer {self.layer_number - 1} (0-based) got no "
                           "memory inputs: run it inside FactorEngramHybridModel.forward, with input_ids (or "
                           "memory_indices) on every pipeline stage")


def with_memory_before_attention(stack_spec: ModuleSpec, memory_config: MemoryConfig, pattern: str,
                                 table_sharding: str = "replicated") -> ModuleSpec:
    """``stack_spec`` (a ``HybridStack`` spec) whose attention layers are `MemoryBeforeAttentionLayer`s."""
    if memory_config.placement != "before_attn":
        raise ValueError(f"MemoryConfig.placement={memory_config.placement!r}: the hybrid model places the memory "
                         "before the attention of its attention layers ('before_attn'); the FFN placements are not "
                         "in it yet")
    attention = stack_spec.submodules.attention_layer
    if attention.module is not TransformerLayer:
        raise ValueError(f"the hybrid stack's attention layer is {attention.module.__name__}; the memory wraps "
                         "megatron-core's TransformerLayer")
    params = dict(attention.params or {}, memory_config=memory_config, table_sharding=table_sharding,
                  memory_positions=memory_positions(pattern, memory_config.layers))
    layer = dataclasses.replace(attention, module=MemoryBeforeAttentionLayer, params=params)
    return dataclasses.replace(stack_spec, submodules=dataclasses.replace(stack_spec.submodules,
                                                                          attention_layer=layer))


class FactorEngramHybridModel(HybridModel):
    """``HybridModel`` with the memory branch (see the module docstring): the same constructor plus
    ``memory_config`` and ``table_sharding``, and the same forward plus an optional ``memory_indices``
    (``{memory layer index: [s, b, branches]}``, e.g. hashed before a context-parallel split)."""

    def __init__(self, config, hybrid_stack_spec: ModuleSpec, vocab_size: int, max_sequence_length: int,
                 hybrid_layer_pattern: str, memory_config: MemoryConfig, table_sharding: str = "replicated",
                 **kwargs):
        if memory_config.vocab_size > vocab_size:
            raise ValueError(f"MemoryConfig.vocab_size={memory_config.vocab_size} exceeds the model's "
                             f"vocab_size={vocab_size}")
        if memory_config.hidden_size != config.hidden_size:
            raise ValueError(f"MemoryConfig.backbone.hidden_size={memory_config.hidden_size} does not match "
                             f"TransformerConfig.hidden_size={config.hidden_size}")
        if "/" in hybrid_layer_pattern:
            raise ValueError(f"hybrid_layer_pattern {hybrid_layer_pattern!r}: multi-token prediction layers ('/') "
                             "are not supported with memory layers")
        spec = with_memory_before_attention(hybrid_stack_spec, memory_config, hybrid_layer_pattern, table_sharding)
        super().__init__(config, spec, vocab_size, max_sequence_length, hybrid_layer_pattern=hybrid_layer_pattern,
                         **kwargs)
        self.memory_config = memory_config
        self.stage_memory_layers = [layer for layer in self.decoder.layers
                                    if isinstance(layer, MemoryBeforeAttentionLayer) and layer.memory is not None]
        self.hasher = MicrobatchHasher(memory_config, [layer.memory_index for layer in self.stage_memory_layers]) \
            if self.stage_memory_layers else None

    def forward(self, input_ids, position_ids, attention_mask, *args, memory_indices: Optional[dict] = None,
                **kwargs):
        if not self.stage_memory_layers:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        memory_indices = self.hasher.for_forward(input_ids, memory_indices, self.config.context_parallel_size)
        branches = {layer.memory_index: layer.memory for layer in self.stage_memory_layers}
        addresses = {index: memory_indices[index] for index in branches}
        if self.config.recompute_granularity == "full" and self.training:
            started = [index for index, value in addresses.items() if not isinstance(value, torch.Tensor)]
            if started:
                raise ValueError(f"memory layers {started}: lookups started ahead cannot be read again in a full "
                                 "recompute's recomputation; pass their row indices (or input_ids)")
            inputs = StageMemoryInputs(addresses)  # looked up in each run of a layer (see the module docstring)
        else:
            inputs = StageMemoryInputs(start_stage_lookups(branches, addresses))
        for layer in self.stage_memory_layers:
            layer.memory_inputs = inputs
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        finally:
            for layer in self.stage_memory_layers:
                layer.memory_inputs = None

    def start_memory_lookups(self, input_ids: torch.Tensor, device) -> dict:
        """As `FactorEngramGPTModel.start_memory_lookups`: this stage's lookups for ``input_ids`` started now
        (the host tier's lookahead, one microbatch ahead), to pass as ``memory_indices``."""
        if self.hasher is None:
            return {}
        branches = {layer.memory_index: layer.memory for layer in self.stage_memory_layers}
        return start_stage_lookups(branches, self.hasher(input_ids), device)

    def pop_sparsity_loss(self) -> torch.Tensor:
        """As `FactorEngramGPTModel.pop_sparsity_loss`."""
        return pop_stage_sparsity_loss(self.stage_memory_layers)
