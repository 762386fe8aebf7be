"""megatron-core's hybrid stack (`HybridModel`, 0.19 on) built from its local layers, for machines
without Transformer Engine.

megatron-core 0.19's default ``hybrid_stack_spec`` builds its attention, MLP and MoE layers from
Transformer Engine modules, the norm fused into the first linear layer; without Transformer Engine
those names are placeholders and the stack cannot be built. `local_hybrid_stack_spec` builds the
same layers from megatron-core's local ones (`fe_megatron.megatron.layer_specs.get_local_layer_spec`,
the project's norm as a module of its own): ``*`` attention, ``-`` MLP, ``E`` MoE. The other kinds
(Mamba, Gated DeltaNet, MLA, DSA) are not in it yet; `local_pattern_problems` names them.

A ``*-`` pair holds the parameters of one GPT layer under other names
(`fe_megatron.hybrid_pattern.gpt_name_of`): the attention layer the input norm and the
attention, the MLP layer the pre-MLP norm and the MLP.

megatron-core 0.19 and newer (`fe_megatron.megatron.compat.has_hybrid_model`).
"""

from __future__ import annotations

from typing import Optional

from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.transformer.spec_utils import ModuleSpec

from fe_megatron.megatron.norm import TorchNorm

from fe_megatron.hybrid_pattern import ATTENTION, KINDS, MLP, MOE

# the layer kinds the local stack builds, and those it does not
LOCAL_SYMBOLS = {symbol: KINDS[symbol] for symbol in (ATTENTION, MLP, MOE)}
NOT_LOCAL = {symbol: kind for symbol, kind in KINDS.items() if symbol not in LOCAL_SYMBOLS}


class LocalHybridStack(HybridStack):
    """megatron-core's ``HybridStack`` whose final norm is the project's `TorchNorm` (megatron-core 0.19
    builds it as Transformer Engine's ``TENorm`` whatever the spec says); everything else is upstream's."""

    def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = TorchNorm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)


def local_hybrid_stack_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False) -> ModuleSpec:
    """A ``HybridStack`` spec of megatron-core's local layers (see the module docstring); with
    ``num_experts`` its MoE layers are megatron-core's local MoE."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                             TransformerLayerSubmodules)

    from fe_megatron.megatron.layer_specs import get_local_layer_spec

    gpt = get_local_layer_spec().submodules
    # the checkpoint names of Transformer Engine's fused norms, as megatron-core's local GPT layer keeps them:
    # checkpoints then load across the local and Transformer Engine stacks, and from GPT checkpoints
    norm_names = gpt.sharded_state_dict_keys_map
    attention_names = {k: v for k, v in norm_names.items() if k.startswith("input_layernorm")}
    mlp_names = {k: v for k, v in norm_names.items() if k.startswith("pre_mlp_layernorm")}
    layers = dict(
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=gpt.input_layernorm, self_attention=gpt.self_attention, self_attn_bda=gpt.self_attn_bda,
            sharded_state_dict_keys_map=attention_names)),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda,
            sharded_state_dict_keys_map=mlp_names)))
    if num_experts:
        moe = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm)
        layers["moe_layer"] = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=moe, mlp_bda=gpt.mlp_bda,
            sharded_state_dict_keys_map=mlp_names))  # as megatron-core's local MoE GPT layer names it
    return ModuleSpec(module=LocalHybridStack, submodules=HybridStackSubmodules(**layers))


def local_pattern_problems(pattern: str) -> list:
    """What `local_hybrid_stack_spec` cannot build of ``pattern`` (a ``--hybrid-layer-pattern``): one entry
    per layer kind (empty: nothing)."""
    return [f"--hybrid-layer-pattern {pattern!r}: {symbol!r} layers ({kind}) are not in the local hybrid stack, "
            f"which builds {', '.join(repr(s) for s in LOCAL_SYMBOLS)} ({', '.join(LOCAL_SYMBOLS.values())}) "
            "layers without Transformer Engine" for symbol, kind in NOT_LOCAL.items() if symbol in pattern]
