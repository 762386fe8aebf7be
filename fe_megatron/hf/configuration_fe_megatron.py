"""`FactorEngramConfig`: the Hugging Face configuration of an fe_megatron model.

It is a `LlamaConfig` (the backbone fe-pretrain trains is Llama's: RoPE, RMSNorm, SwiGLU, no
biases) plus ``memory``: the `fe_megatron.config.MemoryConfig` fields other than its backbone
(``None`` for a plain Transformer), and ``table_storage``: where a loaded model keeps its tables,
``"memory"`` (the default) or ``"mmap"`` (read from the safetensors files, memory-mapped:
``from_pretrained(DIR, table_storage="mmap")``, `fe_megatron.hf.mmap_tables`).  The backbone is never written twice: the memory's
backbone is rebuilt from the Llama fields by `backbone_config`.

This file is also written next to converted weights, for ``trust_remote_code=True`` loading.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from fe_megatron.config import BackboneConfig, MemoryConfig


@strict
class FactorEngramConfig(LlamaConfig):
    model_type = "fe_megatron"

    memory: Optional[dict] = None
    table_storage: str = "memory"

    def backbone_config(self) -> BackboneConfig:
        """The fe_megatron backbone these Llama fields describe."""
        rope = self.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters {rope} use RoPE scaling {rope.get('rope_type')!r}; fe_megatron's "
                             "backbone supports plain RoPE only")
        groups = self.num_key_value_heads
        return BackboneConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=None if groups in (None, self.num_attention_heads) else groups,
            ffn_hidden_size=self.intermediate_size, seq_length=self.max_position_embeddings,
            init_std=self.initializer_range, norm_eps=self.rms_norm_eps,
            rope_base=float(rope.get("rope_theta", 10000.0)), tie_embeddings=bool(self.tie_word_embeddings),
            dropout=float(self.attention_dropout or 0.0))

    def memory_config(self) -> Optional[MemoryConfig]:
        """The `MemoryConfig` of the branches (None: no memory)."""
        if self.memory is None:
            return None
        return MemoryConfig(backbone=self.backbone_config(), **self.memory)

    @classmethod
    def from_fe_megatron(cls, backbone: BackboneConfig, memory: Optional[MemoryConfig] = None,
                         **kwargs) -> "FactorEngramConfig":
        """The config of a model with ``backbone`` and ``memory``; ``kwargs`` sets further HF fields
        (token ids, for example).  A backbone with experts (``num_experts``) is refused: this
        model's FFN is dense."""
        if backbone.num_experts:
            raise ValueError(f"the backbone has {backbone.num_experts} experts per layer (model.num_experts), and the "
                             "Hugging Face model's FFN is dense: an MoE model has no Hugging Face form here "
                             "(fe-pretrain reports its validation and test perplexity in the run's metrics.jsonl)")
        memory_fields = None
        if memory is not None:
            memory_fields = {f.name: getattr(memory, f.name) for f in dataclasses.fields(memory)
                             if f.name != "backbone"}
        return cls(vocab_size=backbone.vocab_size, hidden_size=backbone.hidden_size,
                   num_hidden_layers=backbone.num_layers, num_attention_heads=backbone.num_attention_heads,
                   num_key_value_heads=backbone.num_query_groups or backbone.num_attention_heads,
                   intermediate_size=backbone.ffn_hidden_size, max_position_embeddings=backbone.seq_length,
                   initializer_range=backbone.init_std, rms_norm_eps=backbone.norm_eps,
                   rope_parameters={"rope_type": "default", "rope_theta": backbone.rope_base},
                   tie_word_embeddings=backbone.tie_embeddings, attention_dropout=backbone.dropout,
                   hidden_act="silu", attention_bias=False, mlp_bias=False, memory=memory_fields, **kwargs)
