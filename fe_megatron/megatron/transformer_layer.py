"""Megatron TransformerLayer / TransformerBlock subclasses that host the memory branch.

Layer numbering: `MemoryConfig.layers` holds 0-based indices (the paper's "layers 10 and 12
of 24", see `fe_megatron.config`); Megatron's ``layer_number`` is 1-based and global across
pipeline stages, so the branch sits on the layer with ``layer_number == layer_index + 1``.
`FactorEngramTransformerLayer.__init__` is the one place that converts.

Memory indices travel as arguments: the model hashes once per microbatch and calls the block
with ``memory_indices`` (``{layer_index: [s, b, branches]}``); the block passes each memory
layer its own tensor as the ``memory_indices`` argument of the layer's forward, and under full
activation recompute passes them as explicit inputs of the checkpointed function, so the
recomputation in backward uses the same microbatch's indices even when a pipeline schedule
has run later microbatches' forwards in between.  Nothing is stored on a module.

What the branch reads (h_t of Eq. 7): the residual stream at the insertion point, i.e. the
layer input for ``before_attn`` and the post-attention residual for ``before_ffn`` and
``inside_ffn``.  That is the tensor before any norm, so the branch sees the same h_t under the
local spec and under Transformer Engine's fused norm+QKV linear.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.enums import Fp8Recipe
from megatron.core.utils import WrappedTensor, deprecate_inference_params, make_viewless_tensor

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron.memory_layer import build_memory_branch, memory_sharded_state_dict
from fe_megatron.megatron.sparsity import attach_sparsity_loss


def validate_against_transformer_config(memory_config: MemoryConfig, config) -> None:
    """Build-time checks that need the TransformerConfig (the memory's backbone must be the model's)."""
    for layer in memory_config.layers:
        if layer >= config.num_layers:
            raise ValueError(f"MemoryConfig.layers: layer {layer} (0-based) is beyond the model's "
                             f"num_layers={config.num_layers}; allowed range [0, {config.num_layers - 1}]")
    for name in ("hidden_size", "num_layers"):
        if getattr(memory_config, name) != getattr(config, name):
            raise ValueError(f"MemoryConfig.backbone.{name}={getattr(memory_config, name)} does not match "
                             f"TransformerConfig.{name}={getattr(config, name)}")
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
            raise ValueError(f"MemoryConfig.backbone.ffn_hidden_size={memory_config.ffn_hidden_size} does not match "
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
    """A TransformerLayer with a memory branch (``self.memory``, a `fe_megatron.memory.FactorEngram`
    or `Engram`) when its 0-based ``layer_index`` is in ``memory_config.layers``."""

    def __init__(self, config, submodules, layer_number: int = 1, hidden_dropout=None, pg_collection=None,
                 vp_stage=None, memory_config: Optional[MemoryConfig] = None, table_sharding: str = "replicated"):
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage)
        if memory_config is None:
            raise ValueError("FactorEngramTransformerLayer needs memory_config (set it in the spec's params)")
        validate_against_transformer_config(memory_config, config)
        self.memory_config = memory_config
        self.layer_index = self.layer_number - 1  # Megatron's 1-based number -> MemoryConfig.layers' index
        self.memory = None
        if self.layer_index in memory_config.layers:
            self.memory = build_memory_branch(config, memory_config, self.layer_index, self.tp_group, table_sharding)
            if memory_config.placement == "inside_ffn" and type(self.mlp) is not MLP:
                raise ValueError("placement='inside_ffn' adds the memory to a dense SwiGLU MLP "
                                 f"(megatron.core MLP); this layer's MLP is {type(self.mlp).__name__}")
        self.tracked_sparsity_loss: list = []  # detached per-microbatch values, for logging

    # ----------------------------------------------------------------- memory
    def _memory(self, residual_stream: torch.Tensor, indices: torch.Tensor):
        memory_out, l1_share = self.memory(residual_stream, indices=indices)
        mc = self.memory_config
        aux_loss = l1_share.mean() * (mc.sparsity_lambda / len(mc.layers))  # this layer's share of Eq. 12-13
        # Under full recompute the layer runs twice: first inside the checkpoint's forward (grad
        # disabled), then again in backward with grad enabled. Record the value once.
        if torch.is_grad_enabled() or not self.training:
            self.tracked_sparsity_loss.append(aux_loss.detach())
        return memory_out, aux_loss

    def forward(self, hidden_states: torch.Tensor, *args, memory_indices: Optional[torch.Tensor] = None, **kwargs):
        """TransformerLayer.forward plus the memory branch; ``memory_indices`` ([s, b, branches]) are
        this layer's row indices, required on a memory layer."""
        if self.memory is None:
            return super().forward(hidden_states, *args, **kwargs)
        if memory_indices is None:
            raise RuntimeError(f"layer {self.layer_index} (0-based) has a memory branch but received no "
                               "memory_indices; call FactorEngramGPTModel with input_ids (or memory_indices) on "
                               "every pipeline stage")
        kwargs.pop("dynamic_inference_decode_only", None)
        placement = self.memory_config.placement
        aux_loss = None
        if placement == "before_attn":
            memory_out, aux_loss = self._memory(hidden_states, memory_indices)
            hidden_states = hidden_states + memory_out  # Eq. 11
        hidden_states, context = self._forward_attention(hidden_states, *args, **kwargs)
        if placement == "before_ffn":
            memory_out, aux_loss = self._memory(hidden_states, memory_indices)
            hidden_states = hidden_states + memory_out  # Eq. 11
            output = self._forward_mlp(hidden_states, kwargs.get("inference_context"),
                                       padding_mask=kwargs.get("padding_mask"))
        elif placement == "inside_ffn":
            memory_out, aux_loss = self._memory(hidden_states, memory_indices)
            output = self._forward_mlp_with_memory(hidden_states, memory_out)
        else:
            output = self._forward_mlp(hidden_states, kwargs.get("inference_context"),
                                       padding_mask=kwargs.get("padding_mask"))
        return attach_sparsity_loss(output, aux_loss), context

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

    # ----------------------------------------------------------------- checkpointing
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's, with the memory branch's tensors split along the sharding plan's axes."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.memory is not None:
            memory_prefix = f"{prefix}memory."
            for key in [key for key in state if key.startswith(memory_prefix)]:
                del state[key]
            state.update(memory_sharded_state_dict(self.memory, memory_prefix, sharded_offsets, metadata))
        return state


class FactorEngramTransformerBlock(TransformerBlock):
    """TransformerBlock whose forward takes ``memory_indices`` and passes each memory layer its own.

    The forward follows megatron.core's TransformerBlock.forward (viewless input, sequence-parallel
    RNG fork, FP8/FP4 contexts, full recompute, CPU offloading hooks, final norm); the only change
    is the ``memory_indices`` argument of each memory layer's call.
    """

    def forward(self, hidden_states, attention_mask, context=None, context_mask=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                inference_context=None, packed_seq_params=None, sequence_len_offset=None, padding_mask=None, *,
                memory_indices: Optional[dict] = None, inference_params=None, dynamic_inference_decode_only=None):
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        if not self.pre_process:
            hidden_states = self.input_tensor  # set by the pipeline schedule
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        memory_indices = memory_indices or {}
        rng_context = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        with rng_context, self._outer_quantization_context():
            if self.config.recompute_granularity == "full" and self.training:
                hidden_states = self._checkpointed_forward(hidden_states, attention_mask, context, context_mask,
                                                           rotary_pos_emb, attention_bias, packed_seq_params,
                                                           padding_mask, memory_indices)
            else:
                for layer in self.layers:
                    with self.offload_context, self._layer_quantization_context(layer):
                        hidden_states, context = layer(
                            hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                            context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                            rotary_pos_sin=rotary_pos_sin, rotary_pos_cos_sin=rotary_pos_cos_sin,
                            attention_bias=attention_bias, inference_context=inference_context,
                            packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                            padding_mask=padding_mask, **_memory_kwargs(layer, memory_indices))
                    if (torch.is_grad_enabled() and self.config.cpu_offloading
                            and self.group_prefetch_offload_commit_async is not None):
                        hidden_states = self.group_prefetch_offload_commit_async(hidden_states)
        if self.final_layernorm is not None:
            hidden_states = make_viewless_tensor(inp=self.final_layernorm(hidden_states), requires_grad=True,
                                                 keep_graph=True)
        if not self.pre_process and len(self.layers) == 0 and not self.final_layernorm:
            hidden_states = hidden_states.clone()  # an empty stage must not hand back its input node
        return hidden_states

    def _outer_quantization_context(self):
        if self.config.fp8 and self.config.fp8_recipe == Fp8Recipe.delayed:
            from megatron.core.fp8_utils import get_fp8_context

            return get_fp8_context(self.config)
        return nullcontext()

    def _layer_quantization_context(self, layer):
        if self.config.fp8 and self.config.fp8_recipe != Fp8Recipe.delayed:
            from megatron.core.fp8_utils import get_fp8_context

            return get_fp8_context(self.config, layer.layer_number - 1)
        if self.config.fp4:
            from megatron.core.fp4_utils import get_fp4_context

            return get_fp4_context(self.config, layer.layer_number - 1)
        return nullcontext()

    def _checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                              attention_bias, packed_seq_params, padding_mask, memory_indices: dict):
        """Full activation recompute ('uniform' and 'block', as TransformerBlock._checkpointed_forward);
        each checkpointed chunk receives its memory layers' indices as explicit inputs."""
        if self.config.fp8 or self.config.fp4:
            raise NotImplementedError("full activation recompute with FP8/FP4 is not supported with FactorEngram "
                                      "layers yet; use recompute_granularity='selective'")

        def run_layers(start: int, end: int):
            layers = [self._get_layer(index) for index in range(start, end)]
            memory_layers = [layer for layer in layers if getattr(layer, "memory", None) is not None]

            def forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb, padding_mask,
                        *layer_indices):
                indices = dict(zip([layer.layer_index for layer in memory_layers], layer_indices))
                for layer in layers:
                    hidden_states, context = layer(
                        hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                        context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                        inference_context=None, packed_seq_params=packed_seq_params, padding_mask=padding_mask,
                        **_memory_kwargs(layer, indices))
                return hidden_states, context

            inputs = [memory_indices.get(layer.layer_index) for layer in memory_layers]
            return forward, inputs

        def checkpointed(start: int, end: int):
            forward, layer_indices = run_layers(start, end)
            return tensor_parallel.checkpoint(forward, self.config.distribute_saved_activations, hidden_states,
                                              attention_mask, context, context_mask, rotary_pos_emb, padding_mask,
                                              *layer_indices)

        num_layers = self.num_layers_per_pipeline_rank
        if self.config.recompute_method == "uniform":
            for start in range(0, num_layers, self.config.recompute_num_layers):
                hidden_states, context = checkpointed(start, start + self.config.recompute_num_layers)
        elif self.config.recompute_method == "block":
            for index in range(num_layers):
                if index < self.config.recompute_num_layers:
                    hidden_states, context = checkpointed(index, index + 1)
                else:
                    forward, layer_indices = run_layers(index, index + 1)
                    hidden_states, context = forward(hidden_states, attention_mask, context, context_mask,
                                                     rotary_pos_emb, padding_mask, *layer_indices)
        else:
            raise ValueError(f"invalid recompute_method {self.config.recompute_method!r}; expected 'uniform' or 'block'")
        return hidden_states


def _memory_kwargs(layer, memory_indices: dict) -> dict:
    """The ``memory_indices`` argument for ``layer``'s call: its own indices if it has a memory branch."""
    if getattr(layer, "memory", None) is None:
        return {}
    return {"memory_indices": memory_indices.get(layer.layer_index)}


def memory_layer_spec(base_layer_spec: ModuleSpec, memory_config: MemoryConfig,
                      table_sharding: str = "replicated") -> ModuleSpec:
    """Wrap a GPT layer spec: same submodules, our layer class, the memory config as a parameter."""
    return ModuleSpec(module=FactorEngramTransformerLayer, submodules=base_layer_spec.submodules,
                      params={"memory_config": memory_config, "table_sharding": table_sharding})
