"""fe-convert (`fe_megatron.convert`): bad input is refused by name and nothing is written. graft's presets,
as the command lists them, are tests/integration/test_commands.py's."""

import os

import pytest

from fe_megatron.convert.common import ConversionError
from fe_megatron.convert.graft import graft
from fe_megatron.convert.to_hf import mcore_to_hf
from fe_megatron.convert.to_mcore import hf_to_mcore
from tests.helpers.models import tiny_model


def test_bad_input_is_refused_and_nothing_is_written(tmp_path, base_llama):
    from transformers import GPT2Config, GPT2LMHeadModel

    from fe_megatron.convert.cli import main

    not_a_run = tmp_path / "empty"
    not_a_run.mkdir()
    with pytest.raises(ConversionError, match="not an fe-pretrain checkpoint directory"):
        mcore_to_hf(str(not_a_run), str(tmp_path / "out1"))
    assert not os.path.exists(tmp_path / "out1") and not os.path.exists(tmp_path / "out1.tmp")

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(gpt2)
    with pytest.raises(ConversionError, match="model_type is 'gpt2'"):
        graft(str(gpt2), "factorengram-tiny", str(tmp_path / "out2"))
    assert not os.path.exists(tmp_path / "out2")

    with pytest.raises(ConversionError, match=r"memory layers \[7\] do not exist in the base model: it has 4 layers"):
        graft(base_llama, "factorengram-tiny", str(tmp_path / "out3"), layers=[1, 7])
    assert not os.path.exists(tmp_path / "out3") and not os.path.exists(tmp_path / "out3.tmp")

    small_vocab = tmp_path / "small_vocab"  # 256 embedding rows, a 512-token tokenizer beside them
    tiny_model().save_pretrained(small_vocab)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(base_llama).save_pretrained(small_vocab)
    with pytest.raises(ConversionError, match=r"the tokenizer has 512 tokens but the model's vocabulary has 256"):
        hf_to_mcore(str(small_vocab), str(tmp_path / "out4"))
    assert not os.path.exists(tmp_path / "out4") and not os.path.exists(tmp_path / "out4.tmp")

    assert main(["mcore-to-hf", "--load", str(not_a_run), "--output", str(tmp_path / "out5")]) == 2
