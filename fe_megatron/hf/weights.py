"""Names and layouts of the same weights in a Megatron checkpoint and in `FactorEngramForCausalLM`.

One table of rules, read in both directions.  Two tensors change layout:

* ``linear_qkv.weight`` holds, per query group, that group's query heads, then its key head,
  then its value head (``[groups, heads/groups + 2, head_dim, hidden]``); transformers keeps
  ``q_proj`` / ``k_proj`` / ``v_proj`` apart;
* ``linear_fc1.weight`` is the SwiGLU's ``[gate; up]``; transformers keeps ``gate_proj`` and
  ``up_proj`` apart.

The memory branch has the same parameter names on both sides (it is the same module); its
tensors pass through unchanged, which is what lets a conversion stream the tables without a copy.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from fe_megatron.config import BackboneConfig

# (Megatron names within a layer, Hugging Face names within a layer); the first Megatron name is
# what the local spec writes, the second what Transformer Engine's fused norm+linear writes.
LAYER_RULES = (
    (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"), ("input_layernorm.weight",)),
    (("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), ("post_attention_layernorm.weight",)),
    (("self_attention.linear_qkv.weight",), ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.v_proj.weight")),
    (("self_attention.linear_proj.weight",), ("self_attn.o_proj.weight",)),
    (("mlp.linear_fc1.weight",), ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    (("mlp.linear_fc2.weight",), ("mlp.down_proj.weight",)),
)
GLOBAL_RULES = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                "decoder.final_layernorm.weight": "model.norm.weight",
                "output_layer.weight": "lm_head.weight"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def is_weight(megatron_name: str) -> bool:
    """Whether a checkpoint key is a model weight (not Transformer Engine's extra state)."""
    return "_extra_state" not in megatron_name


def hf_names(megatron_name: str) -> Optional[tuple]:
    """The Hugging Face names one Megatron weight becomes (None: not a model weight we know)."""
    if megatron_name in GLOBAL_RULES:
        return (GLOBAL_RULES[megatron_name],)
    match = _LAYER.match(megatron_name)
    if not match:
        return None
    layer, rest = match.groups()
    if rest.startswith("memory."):
        return (f"model.layers.{layer}.{rest}",)
    for megatron_rests, hf_rests in LAYER_RULES:
        if rest in megatron_rests:
            return tuple(f"model.layers.{layer}.{name}" for name in hf_rests)
    return None


def split(megatron_name: str, tensor: torch.Tensor, backbone: BackboneConfig) -> list:
    """``[(hf_name, tensor)]`` for one Megatron weight (views, no copies where the layout allows)."""
    names = hf_names(megatron_name)
    if names is None:
        raise KeyError(f"{megatron_name!r} is not a weight of fe_megatron's GPT model")
    if len(names) == 1:
        return [(names[0], tensor)]
    if megatron_name.endswith("linear_fc1.weight"):
        gate, up = tensor.chunk(2, dim=0)
        return [(names[0], gate), (names[1], up)]
    heads, head_dim, groups = _attention_shape(backbone)
    per_group = tensor.view(groups, heads // groups + 2, head_dim, tensor.shape[-1])
    query = per_group[:, : heads // groups].reshape(heads * head_dim, -1)
    key = per_group[:, heads // groups].reshape(groups * head_dim, -1)
    value = per_group[:, heads // groups + 1].reshape(groups * head_dim, -1)
    return [(names[0], query), (names[1], key), (names[2], value)]


def merge(megatron_name: str, parts: list, backbone: BackboneConfig) -> torch.Tensor:
    """The Megatron weight from its Hugging Face parts (in `hf_names` order): `split`'s inverse."""
    if len(parts) == 1:
        return parts[0]
    if megatron_name.endswith("linear_fc1.weight"):
        return torch.cat(parts, dim=0)
    heads, head_dim, groups = _attention_shape(backbone)
    query, key, value = parts
    hidden = query.shape[-1]
    return torch.cat([query.view(groups, heads // groups, head_dim, hidden), key.view(groups, 1, head_dim, hidden),
                      value.view(groups, 1, head_dim, hidden)], dim=1).reshape(-1, hidden)


def _attention_shape(backbone: BackboneConfig) -> tuple:
    heads = backbone.num_attention_heads
    return heads, backbone.hidden_size // heads, backbone.num_query_groups or heads
