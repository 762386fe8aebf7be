"""megatron-core's layers and blocks as the memory branch uses them: a ``TransformerLayer``'s private
forward steps (the FFN placements run between them), the block's layer count and final norm, the
sharded-state-dict metadata, the fused softmax's kernels, and the MoE router without Transformer
Engine.  The contracts (`fe_megatron.megatron.compat.contracts`) check each on the installed release."""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch

from fe_megatron.megatron.patches import PatchScope


def fused_softmax_available() -> bool:
    """Whether Megatron's fused masked-softmax kernels (``scaled_masked_softmax_cuda`` and its
    causal sibling, from Megatron-LM's fused_kernels or apex) are installed.  Megatron-Core asks
    for them in bf16 and fp16 when ``masked_softmax_fusion`` is set, and fails without them."""
    return all(importlib.util.find_spec(name) is not None
               for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))


def _accepted(function) -> tuple[set, bool]:
    parameters = inspect.signature(function).parameters.values()
    names = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names, any(p.kind is p.VAR_KEYWORD for p in parameters)


@functools.lru_cache(maxsize=None)
def _attention_keywords(layer_class) -> tuple[frozenset, bool]:
    names, open_ended = _accepted(layer_class._forward_attention)
    return frozenset(names), open_ended


def forward_attention(layer, hidden_states: torch.Tensor, args: tuple, kwargs: dict):
    """``TransformerLayer._forward_attention``: input norm, self-attention and its residual add.
    Keywords the block passes that this release's attention step does not take (for example
    ``dynamic_inference_decode_only``) are dropped.  Returns ``(hidden_states, context)``."""
    names, open_ended = _attention_keywords(type(layer))
    if not open_ended:
        kwargs = {key: value for key, value in kwargs.items() if key in names}
    return layer._forward_attention(hidden_states, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _mlp_takes_packed_seq_params(layer_class) -> bool:
    return "packed_seq_params" in inspect.signature(layer_class._forward_mlp).parameters


def forward_mlp(layer, hidden_states: torch.Tensor, kwargs: dict):
    """``TransformerLayer._forward_mlp``: pre-MLP norm, MLP and its residual add, with the
    arguments this release takes (``packed_seq_params`` from 0.17 on)."""
    extra = {"padding_mask": kwargs.get("padding_mask")}
    if _mlp_takes_packed_seq_params(type(layer)):
        extra["packed_seq_params"] = kwargs.get("packed_seq_params")
    return layer._forward_mlp(hidden_states, kwargs.get("inference_context"), **extra)


def pre_mlp_layernorm(layer, hidden_states: torch.Tensor) -> torch.Tensor:
    """``TransformerLayer._forward_pre_mlp_layernorm`` (the norm before the MLP, with its recompute)."""
    return layer._forward_pre_mlp_layernorm(hidden_states)


def post_mlp(layer, mlp_output_with_bias, residual: torch.Tensor) -> torch.Tensor:
    """``TransformerLayer._forward_post_mlp``: the MLP's bias-dropout-add onto the residual.  Where
    a release has no such step, the same bias-dropout-add, as its ``_forward_mlp`` does it (without
    0.19's pre-MLP-norm recompute and activation offloading, which fe_megatron does not turn on)."""
    if hasattr(layer, "_forward_post_mlp"):
        return layer._forward_post_mlp(mlp_output_with_bias, residual)
    from megatron.core.utils import make_viewless_tensor

    output = layer.mlp_bda(layer.training, layer.config.bias_dropout_fusion)(
        mlp_output_with_bias, residual, layer.hidden_dropout)
    return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)


def num_layers_to_build(config, vp_stage, pp_rank: int) -> int:
    """``transformer_block.get_num_layers_to_build``: this pipeline stage's layer count."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    return get_num_layers_to_build(config, vp_stage, pp_rank)


def default_block_norm():
    """``transformer_block.LayerNormImpl``: the final norm megatron-core picks (TE, Apex or torch)."""
    from megatron.core.transformer import transformer_block

    return transformer_block.LayerNormImpl


def ensure_metadata_dp_cp_group(metadata):
    """``transformer.utils.ensure_metadata_has_dp_cp_group``'s data-parallel (with context) group."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    return ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]


def repair_moe_router_without_te(scope: PatchScope) -> None:
    """megatron-core 0.16's MoE router reads ``moe_utils.te_general_gemm``, which that release binds
    only when Transformer Engine imports (later releases bind None otherwise): bind None until
    ``scope`` closes, so that the router takes its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        scope.replace(moe_utils, "te_general_gemm", None)
