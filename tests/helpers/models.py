"""Tiny Hugging Face models (`fe_megatron.hf`) built in the test process: a FactorEngram or Engram
model whose memory branches matter from the start."""

import torch

from fe_megatron.config import BackboneConfig, MemoryConfig
from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM

BACKBONE = BackboneConfig(vocab_size=256, hidden_size=64, num_layers=3, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=128, seq_length=256)


def tiny_model(kind="factorengram", placement="before_attn", perturb=True):
    gate, width = ("basis", 48) if kind == "factorengram" else ("scalar", 48)
    memory = MemoryConfig(backbone=BACKBONE, kind=kind, gate=gate, ngram_orders=[1, 2, 3], heads_per_order=2,
                          table_capacity=[256, 1000, 1000], coeff_width=width, memory_dim=32 if gate == "basis" else 48,
                          layers=[0, 2], placement=placement)
    config = FactorEngramConfig.from_fe_megatron(BACKBONE, memory, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = FactorEngramForCausalLM(config).eval()
    if perturb:
        make_memory_matter(model, 0.2)
    return model


def make_memory_matter(model, std: float):
    """Draw every memory branch's ``V`` and convolution weights from N(0, std^2): both start at zero, so a fresh
    branch outputs nothing."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".memory." in name and ("value_proj" in name or "conv.weight" in name):
                param.normal_(0, std)


def with_table_dtype(model, table_dtype: str):
    """``model`` (a `FactorEngramForCausalLM` with fp32 tables) with its tables stored as ``table_dtype``, as
    ``fe-convert --table-dtype`` writes them; the model itself when ``table_dtype`` is fp32."""
    if table_dtype == "fp32":
        return model
    config = FactorEngramConfig.from_dict(dict(model.config.to_dict(), memory=dict(model.config.memory,
                                                                                   table_dtype=table_dtype)))
    quantized = FactorEngramForCausalLM(config).eval()
    weights = model.state_dict()
    with torch.no_grad():
        for name, param in quantized.named_parameters():
            if name.endswith("tables.weight"):
                quantized.get_submodule(name[:-len(".weight")]).store_(weights[name])
            elif not name.endswith("row_scale"):
                param.copy_(weights[name])
    return quantized
