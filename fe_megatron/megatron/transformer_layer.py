"""Megatron TransformerLayer / TransformerBlock / MLP subclasses that host the memory branch.

Layer numbering: `MemoryConfig.layers` holds 0-based indices (the paper's "layers 10 and
12 of 24"); Megatron's ``layer_number`` is 1-based and global across pipeline stages, so
the branch sits on the layer with ``layer_number == index + 1``.

Index hand-off: the model hashes once per microbatch and passes ``memory_indices``
(``{layer_index: [s, b, branches]}``) to the block's forward.  The block hands each
memory layer its own indices for the duration of that forward call, and under full
activation recompute it captures them in the recompute closure, so the recomputation in
backward uses the same microbatch's indices even when a pipeline schedule has run later
microbatches' forwards in between.  Nothing is kept after the call returns.

What the branch reads (h_t of Eq. 7): the residual stream at the insertion point, i.e.
the layer input for ``before_attn`` and the post-attention residual for ``before_ffn``
and ``inside_ffn``.  That is the tensor before any norm, so the branch sees the same
h_t under the local spec and under Transformer Engine's fused norm+QKV linear.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron.memory_layer import build_parallel_memory
from fe_megatron.megatron.sparsity import attach_sparsity_loss


def validate_against_transformer_config(memory_config: MemoryConfig, config) -> None:
    """Build-time checks that need the TransformerConfig."""
    for layer in memory_config.layers:
        if layer >= config.num_layers:
            raise ValueError(f"MemoryConfig.layers: layer {layer} (0-based) is beyond the model's "
                             f"num_layers={config.num_layers}; allowed range [0, {config.num_layers - 1}]")
    if memory_config.hidden_size != config.hidden_size:
        raise ValueError(f"MemoryConfig.hidden_size={memory_config.hidden_size} does not match "
                         f"TransformerConfig.hidden_size={config.hidden_size}")
    if memory_config.num_layers != config.num_layers:
        raise ValueError(f"MemoryConfig.num_layers={memory_config.num_layers} does not match "
                         f"TransformerConfig.num_layers={config.num_layers}")
    tp = config.tensor_model_parallel_size
    if memory_config.branch_width % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} does not divide the branch width "
                         f"s_b={memory_config.branch_width} (coeff_width={memory_config.coeff_width} / "
                         f"{memory_config.num_branches} branches)")
    if memory_config.placement == "inside_ffn":
        if not config.gated_linear_unit or config.activation_func is not F.silu:
            raise ValueError("placement='inside_ffn' adds the memory to the SwiGLU up-projection and needs "
                             "gated_linear_unit=True with activation_func=F.silu; this model's MLP is not SwiGLU")
        if memory_config.ffn_hidden_size != config.ffn_hidden_size:
            raise ValueError(f"MemoryConfig.ffn_hidden_size={memory_config.ffn_hidden_size} does not match "
                             f"TransformerConfig.ffn_hidden_size={config.ffn_hidden_size} (placement='inside_ffn')")
        if config.ffn_hidden_size % tp:
            raise ValueError(f"tensor_model_parallel_size={tp} does not divide ffn_hidden_size={config.ffn_hidden_size}")
        if config.bias_activation_fusion or getattr(config, "use_te_activation_func", False):
            raise ValueError("placement='inside_ffn' needs the unfused SwiGLU (bias_activation_fusion=False, "
                             "use_te_activation_func=False) so the memory can be added to the up-projection")


def swiglu_with_up_addend(mlp: MLP, hidden_states: torch.Tensor, up_addend: torch.Tensor):
    """Megatron's SwiGLU MLP with a memory output added to its up-projection branch (``inside_ffn``):
    ``fc2(silu(x W_gate) * (x W_up + m))``. ``up_addend`` holds this TP rank's FFN columns."""
    intermediate, bias = mlp.linear_fc1(hidden_states)
    if bias is not None:
        intermediate = intermediate + bias
    gate, up = torch.chunk(intermediate, 2, dim=-1)
    intermediate = mlp.config.activation_func(gate) * (up + up_addend + mlp.config.glu_linear_offset)
    return mlp.linear_fc2(intermediate)


class FactorEngramTransformerLayer(TransformerLayer):
    """A TransformerLayer with the memory branch when ``layer_number - 1`` is in ``memory_config.layers``."""

    def __init__(self, config, submodules, layer_number: int = 1, hidden_dropout=None, pg_collection=None,
                 vp_stage=None, memory_config: Optional[MemoryConfig] = None):
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage)
        if memory_config is None:
            raise ValueError("FactorEngramTransformerLayer needs memory_config (set it in the spec's params)")
        validate_against_transformer_config(memory_config, config)
        self.memory_config = memory_config
        self.memory_index = self.layer_number - 1
        self.memory = None
        if self.memory_index in memory_config.layers:
            self.memory = build_parallel_memory(config, memory_config, self.memory_index, self.tp_group)
            if memory_config.placement == "inside_ffn" and type(self.mlp) is not MLP:
                raise ValueError("placement='inside_ffn' adds the memory to a dense SwiGLU MLP "
                                 f"(megatron.core MLP); this layer's MLP is {type(self.mlp).__name__}")
        self.memory_indices: Optional[torch.Tensor] = None  # set by the block for one forward call
        self.sparsity_loss_scale = 1.0  # set by the model: 1 / num_microbatches under Megatron schedules
        self.tracked_sparsity_loss: list = []  # detached per-microbatch values, for logging

    # ----------------------------------------------------------------- memory
    def _memory(self, residual_stream: torch.Tensor, indices: torch.Tensor):
        memory_out, l1_share = self.memory(residual_stream, indices)
        mc = self.memory_config
        aux_loss = l1_share.mean() * (mc.sparsity_lambda / len(mc.layers))  # this layer's share of Eq. 12-13
        # Under full recompute the layer runs twice: first inside the checkpoint's forward (grad
        # disabled), then again in backward with grad enabled. Record the value once.
        if torch.is_grad_enabled() or not self.training:
            self.tracked_sparsity_loss.append(aux_loss.detach())
        return memory_out, aux_loss

    def _indices(self, memory_indices: Optional[torch.Tensor]) -> torch.Tensor:
        indices = memory_indices if memory_indices is not None else self.memory_indices
        if indices is None:
            raise RuntimeError(f"layer {self.layer_number} has a memory branch but received no memory indices; "
                               "call FactorEngramGPTModel with input_ids (or memory_indices) on every pipeline stage")
        return indices

    def forward(self, hidden_states: torch.Tensor, *args, memory_indices: Optional[torch.Tensor] = None, **kwargs):
        if self.memory is None:
            return super().forward(hidden_states, *args, **kwargs)
        indices = self._indices(memory_indices)
        kwargs.pop("dynamic_inference_decode_only", None)
        placement = self.memory_config.placement
        aux_loss = None
        if placement == "before_attn":
            memory_out, aux_loss = self._memory(hidden_states, indices)
            hidden_states = hidden_states + memory_out  # Eq. 11
        hidden_states, context = self._forward_attention(hidden_states, *args, **kwargs)
        if placement == "before_ffn":
            memory_out, aux_loss = self._memory(hidden_states, indices)
            hidden_states = hidden_states + memory_out
            output = self._forward_mlp(hidden_states, kwargs.get("inference_context"),
                                       padding_mask=kwargs.get("padding_mask"))
        elif placement == "inside_ffn":
            memory_out, aux_loss = self._memory(hidden_states, indices)
            output = self._forward_mlp_with_memory(hidden_states, memory_out)
        else:
            output = self._forward_mlp(hidden_states, kwargs.get("inference_context"),
                                       padding_mask=kwargs.get("padding_mask"))
        return attach_sparsity_loss(output, aux_loss, self.sparsity_loss_scale), context

    def _forward_mlp_with_memory(self, hidden_states: torch.Tensor, memory_out: torch.Tensor):
        """``inside_ffn``: the pre-MLP norm, the SwiGLU with ``m`` on its up branch, the residual add."""
        residual = hidden_states
        normed = self._forward_pre_mlp_layernorm(hidden_states)
        if self.tp_group.size() > 1:  # the up-projection's columns are split over TP
            if self.config.sequence_parallel:  # [s/tp, b, f] -> [s, b, f/tp]
                local_seq, batch, width = memory_out.shape
                memory_out = mappings.all_to_all_sp2hp(memory_out.reshape(local_seq * batch, width),
                                                       group=self.tp_group).reshape(-1, batch, width // self.tp_group.size())
            else:
                memory_out = mappings.scatter_to_tensor_model_parallel_region(memory_out, group=self.tp_group)
        if self.recompute_mlp:
            mlp_out = tensor_parallel.checkpoint(functools.partial(swiglu_with_up_addend, self.mlp), False, normed,
                                                 memory_out)
        else:
            mlp_out = swiglu_with_up_addend(self.mlp, normed, memory_out)
        return self._forward_post_mlp(mlp_out, residual)

    def pop_tracked_sparsity_loss(self) -> Optional[torch.Tensor]:
        """Sum of this layer's tracked aux-loss values since the last call (this rank's TP share)."""
        if not self.tracked_sparsity_loss:
            return None
        total = torch.stack(self.tracked_sparsity_loss).sum()
        self.tracked_sparsity_loss = []
        return total


class FactorEngramTransformerBlock(TransformerBlock):
    """TransformerBlock whose forward accepts ``memory_indices`` and hands them to memory layers."""

    def _memory_layers(self):
        return [layer for layer in self.layers if getattr(layer, "memory", None) is not None]

    def forward(self, *args, memory_indices: Optional[dict] = None, **kwargs):
        layers = self._memory_layers()
        for layer in layers:
            layer.memory_indices = None if memory_indices is None else memory_indices.get(layer.memory_index)
        try:
            return super().forward(*args, **kwargs)
        finally:
            for layer in layers:
                layer.memory_indices = None

    def _checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                              attention_bias, packed_seq_params, use_inner_quantization_context,
                              padding_mask=None):
        """Full activation recompute with the memory indices captured per microbatch.

        Same structure as TransformerBlock._checkpointed_forward ('uniform' and 'block'
        methods); each checkpointed chunk's closure carries its layers' indices.
        """
        if self.config.fp8 or self.config.fp4:
            raise NotImplementedError("full activation recompute with FP8/FP4 is not supported with FactorEngram "
                                      "layers yet; use recompute_granularity='selective'")
        captured = {id(layer): layer.memory_indices for layer in self._memory_layers()}

        def custom(start: int, end: int):
            def custom_forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                               padding_mask=None):
                for index in range(start, end):
                    layer = self._get_layer(index)
                    extra = {"memory_indices": captured[id(layer)]} if id(layer) in captured else {}
                    hidden_states, context = layer(
                        hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                        context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                        inference_context=None, packed_seq_params=packed_seq_params, padding_mask=padding_mask,
                        **extra)
                return hidden_states, context

            return custom_forward

        def checkpointed(start: int, end: int):
            return tensor_parallel.checkpoint(custom(start, end), self.config.distribute_saved_activations,
                                              hidden_states, attention_mask, context, context_mask,
                                              rotary_pos_emb, padding_mask)

        num_layers = self.num_layers_per_pipeline_rank
        if self.config.recompute_method == "uniform":
            index = 0
            while index < num_layers:
                hidden_states, context = checkpointed(index, index + self.config.recompute_num_layers)
                index += self.config.recompute_num_layers
        elif self.config.recompute_method == "block":
            for index in range(num_layers):
                if index < self.config.recompute_num_layers:
                    hidden_states, context = checkpointed(index, index + 1)
                else:
                    hidden_states, context = custom(index, index + 1)(
                        hidden_states, attention_mask, context, context_mask, rotary_pos_emb, padding_mask)
        else:
            raise ValueError(f"invalid recompute_method {self.config.recompute_method!r}; expected 'uniform' or 'block'")
        return hidden_states


def memory_layer_spec(base_layer_spec: ModuleSpec, memory_config: MemoryConfig) -> ModuleSpec:
    """Wrap a GPT layer spec: same submodules, our layer class, the memory config as a parameter."""
    return ModuleSpec(module=FactorEngramTransformerLayer, submodules=base_layer_spec.submodules,
                      params={"memory_config": memory_config})
