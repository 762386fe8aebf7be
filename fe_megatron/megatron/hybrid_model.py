"""`FactorEngramHybridModel`: megatron-core's ``HybridModel`` (0.19 on) with the memory branch before the
attention of chosen attention (``*``) layers.

Layer numbers. `MemoryConfig.layers` counts transformer blocks, as in the paper ("layers 10 and 12 of
24") and in the GPT model: the memory of block ``i`` sits before the attention of the pattern's
``i``-th ``*`` layer (`fe_megatron.hybrid_pattern`: the layer numbers, pipeline stages and
names of a pattern), and hashes as block ``i`` does in the GPT model, so a pattern of ``*-`` pairs is the
GPT model with memory, parameter for parameter (`hybrid_pattern.gpt_name_of`).

The memory's inputs are the model's, as in the GPT model (`fe_megatron.megatron.memory_inputs`: hashed
once per microbatch, lookups scheduled by `fe_megatron.memory.inputs`, handed to this stage's memory layers
for the length of one forward; under full recompute, queued for each recomputation). ``HybridStack`` runs
unchanged.

A memory layer (`MemoryBeforeAttentionLayer`) is megatron-core's attention layer plus the branch: it
adds the branch's output to its input (Eq. 11) and calls ``TransformerLayer``'s public ``forward``. Its
checkpoint is the GPT layer's (`HostsMemory`): the branch's tensors split along the sharding plan's axes,
under ``decoder.layers.<position in the pattern>.memory.``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from fe_megatron.config import MemoryConfig
from fe_megatron.hybrid_pattern import memory_positions
from fe_megatron.megatron.hasher import MicrobatchHasher
from fe_megatron.megatron.memory_inputs import (handed_to, lookups_started_ahead, stage_branches,
                                                stage_memory_inputs)
from fe_megatron.megatron.memory_layer import build_memory_branch
from fe_megatron.megatron.sparsity import attach_sparsity_loss, pop_stage_sparsity_loss
from fe_megatron.megatron.transformer_layer import HostsMemory
from fe_megatron.memory.inputs import MemoryInputs, refuse_renamed_keywords


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
        self._init_memory_inputs()

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if self.memory is None:
            return super().forward(hidden_states, *args, **kwargs)
        memory_out, aux_loss = self._memory(hidden_states)
        output, context = super().forward(hidden_states + memory_out, *args, **kwargs)  # Eq. 11
        return attach_sparsity_loss(output, aux_loss), context


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
    ``memory_config`` and ``table_sharding``, and the same forward plus an optional ``memory_inputs``
    (a `fe_megatron.memory.inputs.MemoryInputs`, e.g. addresses hashed before a context-parallel split)."""

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

    def forward(self, input_ids, position_ids, attention_mask, *args,
                memory_inputs: Optional[MemoryInputs] = None, **kwargs):
        refuse_renamed_keywords(kwargs)
        if not self.stage_memory_layers:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        inputs = self.hasher.for_forward(input_ids, memory_inputs, self.config.context_parallel_size, position_ids)
        inputs = stage_memory_inputs(self.config, self.training, stage_branches(self.stage_memory_layers), inputs)
        with handed_to(self.stage_memory_layers, inputs):
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)

    def start_memory_lookups(self, token_ids: torch.Tensor, device, position_ids=None) -> MemoryInputs:
        """As `FactorEngramGPTModel.start_memory_lookups`: this stage's lookups for ``token_ids`` started now
        (the host tier's lookahead, one microbatch ahead), to pass as ``memory_inputs``."""
        return lookups_started_ahead(self.stage_memory_layers, self.hasher, token_ids, device, position_ids)

    def pop_sparsity_loss(self) -> torch.Tensor:
        """As `FactorEngramGPTModel.pop_sparsity_loss`."""
        return pop_stage_sparsity_loss(self.stage_memory_layers)
