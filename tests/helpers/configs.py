"""The small configurations every tier builds from: ``small_config`` for exact float64 checks in one
process, ``tiny_memory_config`` and ``tiny_transformer_config`` for the tiny Megatron GPT (the tests
and the scripts in ``tests/distributed/`` that torchrun launches)."""

import torch
import torch.nn.functional as F

from fe_megatron.config import BACKBONE_FIELDS, BackboneConfig, MemoryConfig


def split_backbone(values: dict) -> dict:
    """Move the backbone fields of a flat dict of test settings into ``values['backbone']``."""
    backbone = {name: values.pop(name) for name in BACKBONE_FIELDS if name in values}
    backbone.setdefault("num_attention_heads", 2)
    values["backbone"] = BackboneConfig(**backbone)
    return values


def small_config(**overrides) -> MemoryConfig:
    """A configuration small enough for exact float64 checks (backbone fields may be overridden too)."""
    values = dict(vocab_size=97, hidden_size=16, num_layers=4, ffn_hidden_size=24, ngram_orders=[1, 2, 3],
                  heads_per_order=2, table_capacity=[97, 211, 307], coeff_width=24, memory_dim=12, layers=[1, 3],
                  conv_kernel_size=3, conv_dilation=2, hash_seed=7)
    values.update(overrides)
    return MemoryConfig(**split_backbone(values))


def tiny_memory_config(**overrides) -> MemoryConfig:
    """The memory of the tiny test GPT (backbone fields may be overridden too)."""
    values = dict(vocab_size=128, hidden_size=32, num_layers=4, num_attention_heads=4, ffn_hidden_size=64,
                  ngram_orders=[1, 2, 3], heads_per_order=2, table_capacity=[128, 401, 409], coeff_width=24,
                  memory_dim=16, layers=[1, 2], conv_kernel_size=4, conv_dilation=3, sparsity_lambda=1e-2)
    values.update(overrides)
    return MemoryConfig(**split_backbone(values))


def tiny_transformer_config(tp=1, pp=1, sp=False, **overrides):
    """Megatron's TransformerConfig of the tiny test GPT (the backbone of ``tiny_memory_config``), on
    the CPU: no fused kernels, initialized on the CPU."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
                  bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
                  masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                  use_cpu_initialization=True, persist_layer_norm=False, tensor_model_parallel_size=tp,
                  pipeline_model_parallel_size=pp, sequence_parallel=sp, pipeline_dtype=torch.float32)
    values.update(overrides)
    return TransformerConfig(**values)
