"""fe-eval's test models and inputs: a model whose every weight is zero (it predicts the uniform
distribution over its vocabulary, so each token costs exactly log VOCAB) and JSON-lines files."""

import json

import torch

from fe_megatron.config import BackboneConfig, MemoryConfig

VOCAB = 512
LENGTH = 256


def uniform_model(directory: str, tokenizer: str) -> str:
    """Save the uniform model, with ``tokenizer`` converted beside it, in ``directory``."""
    from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM, save_tokenizer

    backbone = BackboneConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=2,
                              ffn_hidden_size=64, seq_length=LENGTH)
    memory = MemoryConfig(backbone=backbone, ngram_orders=[1, 2], heads_per_order=1, table_capacity=[VOCAB, 997],
                          coeff_width=16, memory_dim=16, layers=[1])
    model = FactorEngramForCausalLM(FactorEngramConfig.from_fe_megatron(backbone, memory))
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    model.save_pretrained(directory)
    save_tokenizer(tokenizer, directory)
    return directory


def write_jsonl(path, records):
    with open(path, "w") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
    return str(path)
