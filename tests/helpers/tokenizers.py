"""Converted tokenizers built in the test process: a sentencepiece model fe-data trains on the bundled
corpus, and a directory laid out as ``fe-convert mcore-to-hf`` writes it around one
(tests/unit/hf/test_tokenizer.py, tests/integration/test_hf_loading.py)."""

import gzip
import os

from tests.helpers.paths import CORPUS


def train_fe_data_tokenizer(directory, vocab_size=1000, documents=40) -> str:
    from fe_megatron.data.cli import main as fe_data

    subset = os.path.join(directory, "subset.jsonl")
    with gzip.open(CORPUS, "rt") as src, open(subset, "w") as dst:
        for i, line in enumerate(src):
            if i >= documents:
                break
            dst.write(line)
    prefix = os.path.join(directory, "tok")
    assert fe_data(["train-tokenizer", "--input", subset, "--output-prefix", prefix,
                    "--vocab-size", str(vocab_size)]) == 0
    return prefix + ".model"


def converted_model_directory(base) -> tuple:
    """``(directory, tokenizer model file)``: under ``base``, a converted directory as ``fe-convert mcore-to-hf``
    lays it out: config.json (model_type fe_megatron, auto_map to the modeling files), a tiny random model,
    the tokenizer."""
    import torch

    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.hf import (AUTO_MAP, FactorEngramConfig, FactorEngramForCausalLM, save_tokenizer,
                                write_modeling_files)

    model_file = train_fe_data_tokenizer(str(base), vocab_size=600, documents=20)
    directory = str(base / "hf")
    tokenizer = save_tokenizer(model_file, directory)
    backbone = BackboneConfig(vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_attention_heads=2,
                              ffn_hidden_size=64, seq_length=128)
    memory = MemoryConfig(backbone=backbone, ngram_orders=[1, 2], heads_per_order=1,
                          table_capacity=[len(tokenizer), 997], coeff_width=16, memory_dim=16, layers=[1])
    config = FactorEngramConfig.from_fe_megatron(
        backbone, memory, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, architectures=["FactorEngramForCausalLM"], auto_map=AUTO_MAP)
    torch.manual_seed(0)
    FactorEngramForCausalLM(config).eval().save_pretrained(directory)
    write_modeling_files(directory)
    return directory, model_file
