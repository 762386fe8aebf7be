"""The Megatron TransformerLayer that hosts the memory branch.

Layer numbering: `MemoryConfig.layers` holds 0-based indices (the paper's "layers 10 and 12
of 24", see `fe_megatron.config`); Megatron's ``layer_number`` is 1-based and global across
pipeline stages, so the branch sits on the layer with ``layer_number == layer_index + 1``.
`FactorEngramTransformerLayer.__init__` is the one place that converts.

The memory's inputs come from the model, not through a megatron-core argument: once per microbatch the
model's forward hands this stage's memory layers a `fe_megatron.memory.inputs.MemoryInputs`
(hashed addresses, lookups scheduled), which each layer reads in its own forward
(`memory_inputs.lookup_of_this_call`, which also serves full recompute's recomputations). megatron-core's
``TransformerBlock`` runs unchanged, and its ``context`` argument (cross-attention's input) stays unused.

What the branch reads (h_t of Eq. 7): the residual stream at the insertion point, i.e. the
layer input for ``before_attn`` and the post-attention residual for ``before_ffn`` and
``inside_ffn``.  That is the tensor before any norm, so the branch sees the same h_t under the
local spec and under Transformer Engine's fused norm+QKV linear.
"""

from __future__ import annotations

import collections
import functools
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron import compat
from fe_megatron.megatron.memory_inputs import lookup_of_this_call
from fe_megatron.megatron.memory_layer import build_memory_branch, memory_sharded_state_dict
from fe_megatron.megatron.sparsity import SparsityLossAutoScaler, attach_sparsity_loss
from fe_megatron.memory.inputs import MemoryInputs
from fe_megatron.memory.loss import layer_sparsity, weighted_sparsity


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
            raise ValueError("placement='inside_ffn' adds the memory to the up half of linear_fc1's output before "
                             "megatron-core's unfused SwiGLU, the split its compat contract checks: set "
                             "bias_activation_fusion=False and use_te_activation_func=False")
        if getattr(config, "glu_linear_offset", 0.0) or getattr(config, "activation_func_clamp_value", None) is not None:
            raise ValueError("placement='inside_ffn' computes fc2(silu(x W_gate) * (x W_up + m)) as the Hugging Face "
                             "model does, without glu_linear_offset or activation_func_clamp_value; leave them at "
                             "0 and None")


def mlp_with_up_addend(mlp: MLP, hidden_states: torch.Tensor, up_addend: torch.Tensor):
    """megatron-core's SwiGLU ``MLP.forward``, run as it is, with a memory output added to its up-projection
    branch (``inside_ffn``): ``fc2(silu(x W_gate) * (x W_up + m))``. ``up_addend`` holds this TP rank's FFN
    columns; a forward hook adds ``[0 | m]`` to ``linear_fc1``'s output, whose last axis holds this rank's
    gate columns, then its up columns (`compat` contract "MLP's SwiGLU halves")."""
    added = []

    def add_to_up_half(module, args, output):
        intermediate, bias = output
        if intermediate.shape[-1] != 2 * up_addend.shape[-1]:
            raise RuntimeError(f"inside_ffn: linear_fc1's output has {intermediate.shape[-1]} columns on this rank; "
                               f"the memory's up-branch addend has {up_addend.shape[-1]}, half of what SwiGLU needs")
        added.append(True)
        return intermediate + F.pad(up_addend.to(intermediate.dtype), (up_addend.shape[-1], 0)), bias

    hook = mlp.linear_fc1.register_forward_hook(add_to_up_half)
    try:
        output = mlp(hidden_states)
    finally:
        hook.remove()
    if len(added) != 1:
        raise RuntimeError(f"inside_ffn: megatron-core's MLP.forward ran linear_fc1 {len(added)} times, not once as a "
                           "module, so the memory was not added to its up branch; this megatron-core moved what "
                           "compat's contract \"MLP's SwiGLU halves\" checks")
    return output


class HostsMemory:
    """A megatron-core layer hosting a memory branch (``self.memory``, ``self.memory_config``; None on a
    layer without one) of block ``self.memory_index``: reads this call's inputs from its model
    (`fe_megatron.megatron.memory_inputs`), runs the branch, tracks its sparsity term (Eq. 12-13) per
    microbatch for logging (`pop_tracked_sparsity_loss`; times its log weight, `SparsityLossAutoScaler.log_weight`),
    and checkpoints it along the sharding plan's axes."""

    tracked_sparsity_loss: list
    memory_index: Optional[int]
    memory_inputs: Optional[MemoryInputs]  # this microbatch's, handed over by the model for one forward
    pending_recomputations: collections.deque  # under full recompute: inputs queued for their recomputation

    def _init_memory_inputs(self) -> None:
        self.tracked_sparsity_loss = []
        self.memory_inputs = None
        self.pending_recomputations = collections.deque()

    def _memory(self, residual_stream: torch.Tensor):
        """The branch's output m_t (Eq. 10) on this call's inputs, and its sparsity term (Eq. 12-13)."""
        memory_out, l1_share = self.memory(residual_stream, lookup=lookup_of_this_call(self, residual_stream.device))
        mc = self.memory_config
        aux_loss = weighted_sparsity(layer_sparsity(l1_share, len(mc.layers)), mc.sparsity_lambda)  # Eq. 12-13
        # Under full recompute the layer runs twice: first inside the checkpoint's forward (grad
        # disabled), then again in backward with grad enabled. Record the value once.
        if torch.is_grad_enabled() or not self.training:
            self.tracked_sparsity_loss.append(aux_loss.detach() * SparsityLossAutoScaler.log_weight)
        return memory_out, aux_loss

    def pop_tracked_sparsity_loss(self) -> Optional[torch.Tensor]:
        """Sum of this layer's tracked aux-loss values since the last call (this rank's TP share)."""
        if not self.tracked_sparsity_loss:
            return None
        total = torch.stack(self.tracked_sparsity_loss).sum()
        self.tracked_sparsity_loss = []
        return total

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's, with the memory branch's tensors split along the sharding plan's axes."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.memory is not None:
            memory_prefix = f"{prefix}memory."
            for key in [key for key in state if key.startswith(memory_prefix)]:
                del state[key]
            state.update(memory_sharded_state_dict(self.memory, memory_prefix, sharded_offsets, metadata))
        return state


class FactorEngramTransformerLayer(HostsMemory, TransformerLayer):
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
        self.memory_index = self.layer_index if self.layer_index in memory_config.layers else None
        if self.memory_index is not None:
            self.memory = build_memory_branch(config, memory_config, self.layer_index, self.tp_group, table_sharding)
            if memory_config.placement == "inside_ffn" and type(self.mlp) is not MLP:
                raise ValueError("placement='inside_ffn' adds the memory to a dense SwiGLU MLP "
                                 f"(megatron.core MLP); this layer's MLP is {type(self.mlp).__name__}")
        self._init_memory_inputs()

    # ----------------------------------------------------------------- memory
    def forward(self, hidden_states: torch.Tensor, *args, context=None, **kwargs):
        """TransformerLayer.forward plus the memory branch on this forward's inputs (see the module's
        docstring); returns ``(output, context)``. Before the attention, through the public ``forward``;
        at the FFN placements, between ``TransformerLayer``'s attention and MLP steps (`compat`)."""
        if self.memory is None:
            return super().forward(hidden_states, *args, context=context, **kwargs)
        placement = self.memory_config.placement
        if placement == "before_attn":
            memory_out, aux_loss = self._memory(hidden_states)
            output, context = super().forward(hidden_states + memory_out, *args, context=context, **kwargs)  # Eq. 11
            return attach_sparsity_loss(output, aux_loss), context
        hidden_states, _ = compat.forward_attention(self, hidden_states, args, kwargs)
        memory_out, aux_loss = self._memory(hidden_states)
        if placement == "before_ffn":
            output = compat.forward_mlp(self, hidden_states + memory_out, kwargs)  # Eq. 11
        else:  # inside_ffn
            output = self._forward_mlp_with_memory(hidden_states, memory_out)
        return attach_sparsity_loss(output, aux_loss), context

    def _forward_mlp_with_memory(self, hidden_states: torch.Tensor, memory_out: torch.Tensor):
        """``inside_ffn``: the pre-MLP norm, the SwiGLU with ``m`` on its up branch, the residual add."""
        residual = hidden_states
        normed = compat.pre_mlp_layernorm(self, hidden_states)
        if self.tp_group.size() > 1:  # the up-projection's columns are split over TP
            if self.config.sequence_parallel:  # [s/tp, b, f] -> [s, b, f/tp]
                local_seq, batch, width = memory_out.shape
                memory_out = mappings.all_to_all_sp2hp(memory_out.reshape(local_seq * batch, width),
                                                       group=self.tp_group).reshape(-1, batch, width // self.tp_group.size())
            else:
                memory_out = mappings.scatter_to_tensor_model_parallel_region(memory_out, group=self.tp_group)
        if self.recompute_mlp:
            mlp_out = tensor_parallel.checkpoint(functools.partial(mlp_with_up_addend, self.mlp), False, normed,
                                                 memory_out)
        else:
            mlp_out = mlp_with_up_addend(self.mlp, normed, memory_out)
        return compat.post_mlp(self, mlp_out, residual)


def memory_layer_spec(base_layer_spec: ModuleSpec, memory_config: MemoryConfig,
                      table_sharding: str = "replicated") -> ModuleSpec:
    """Wrap a GPT layer spec: same submodules, our layer class, the memory config as a parameter."""
    return ModuleSpec(module=FactorEngramTransformerLayer, submodules=base_layer_spec.submodules,
                      params={"memory_config": memory_config, "table_sharding": table_sharding})
