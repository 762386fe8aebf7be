"""`fe_megatron.hf.mmap_tables`: memory-mapped tables generate the tokens of tables held in memory."""

import pytest
import torch

from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM
from tests.helpers.models import tiny_model, with_table_dtype


@pytest.mark.parametrize("table_dtype", ["fp32", "fp8"])
def test_memory_mapped_tables_generate_the_same_tokens(tmp_path, table_dtype):
    """table_storage="mmap": the tables stay in the safetensors file (views of a mapping, outside
    the state dict), generation is identical token for token, and such a model is not saved."""
    from transformers import AutoModelForCausalLM

    model = with_table_dtype(tiny_model(), table_dtype)  # a quantized model, as fe-convert --table-dtype writes it
    model.save_pretrained(tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    mapped = AutoModelForCausalLM.from_pretrained(tmp_path / "model", table_storage="mmap").eval()
    tables = mapped.model.layers[0].memory.tables
    assert not isinstance(tables.weight, torch.nn.Parameter) and tables.weight.dtype == model.model.layers[
        0].memory.tables.weight.dtype
    assert not any(name.endswith("tables.weight") for name in mapped.state_dict())
    ids = torch.randint(3, 256, (3, 12))
    settings = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(ids, **settings), mapped.generate(ids, **settings))
    with pytest.raises(ValueError, match="cannot be saved; load it with table_storage='memory'"):
        mapped.save_pretrained(tmp_path / "again")
    unmapped = FactorEngramForCausalLM(FactorEngramConfig.from_dict(dict(mapped.config.to_dict())))
    with pytest.raises(RuntimeError, match="neither in memory nor mapped"):
        unmapped(ids)
