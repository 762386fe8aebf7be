"""Table storage formats (`fe_megatron.tables.storage`): bf16 and fp8 rows for serving.

The quantization error stays within each format's rounding bound, a quantized branch gathers
exactly the dequantized rows of its stored table, and a quantized model initializes to the
quantized values of the fp32 model's draw.  The storage settings training accepts are
tests/unit/training/test_config.py's; training from table stores is tests/unit/tables/test_stage_tables.py's
and tests/integration/test_table_stores.py's."""

import pytest
import torch

from fe_megatron.config import ConfigError
from fe_megatron.memory import build_memory
from fe_megatron.tables.storage import FP8_MAX, dequantize_rows, quantize_table
from tests.helpers.configs import small_config


def test_bf16_rows_round_to_nearest():
    weight = torch.randn(300, 24) * torch.logspace(-3, 2, 300).unsqueeze(1)
    stored = quantize_table(weight, "bf16")
    assert stored.keys() == {"weight"} and stored["weight"].dtype == torch.bfloat16
    error = (dequantize_rows(stored["weight"]) - weight).abs()
    assert (error <= weight.abs() * 2.0 ** -8).all()


def test_fp8_rows_keep_three_mantissa_bits_of_their_own_range():
    """Rows of very different magnitudes each use e4m3's whole range (one scale per row)."""
    weight = torch.randn(300, 24) * torch.logspace(-4, 3, 300).unsqueeze(1)
    weight[7] = 0.0  # an all-zero row stays zero (scale 1, no division by zero)
    stored = quantize_table(weight, "fp8")
    assert stored["weight"].dtype == torch.float8_e4m3fn and stored["row_scale"].shape == (300,)
    restored = dequantize_rows(stored["weight"], stored["row_scale"])
    scale = stored["row_scale"].unsqueeze(1)
    # e4m3: relative spacing 2^-3 (rounding error at most half), subnormal spacing 2^-9 of the scale
    bound = weight.abs() * 2.0 ** -4 + scale * 2.0 ** -10
    assert ((restored - weight).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(restored[7], torch.zeros(24))
    row_max = (stored["weight"].float().abs().amax(dim=1))
    assert torch.allclose(row_max[row_max > 0], torch.full_like(row_max[row_max > 0], FP8_MAX))


@pytest.mark.parametrize("table_dtype", ["bf16", "fp8"])
def test_a_quantized_branch_gathers_its_stored_rows(table_dtype):
    full = build_memory(small_config(), 1)
    full.reset_parameters(seed=11)
    quantized = build_memory(small_config(table_dtype=table_dtype), 1)
    quantized.reset_parameters(seed=11)  # the same draw, then stored
    stored = quantize_table(full.tables.weight, table_dtype)
    assert torch.equal(quantized.tables.weight.float(), stored["weight"].float())
    assert not quantized.tables.weight.requires_grad  # trained bf16 tables live in stores (tables/stage_tables.py)
    indices = torch.randint(0, full.tables.weight.shape[0], (3, 17, small_config().num_branches))
    flat = indices.reshape(-1)
    expected = dequantize_rows(stored["weight"][flat], stored["row_scale"][flat] if table_dtype == "fp8" else None)
    assert torch.equal(quantized.tables.gather(indices), expected.reshape(3, 17, -1))
    hidden = torch.randn(3, 17, small_config().hidden_size)
    tokens = torch.randint(0, small_config().vocab_size, (3, 17))
    with torch.no_grad():
        for module in (full, quantized):  # make the output depend on the tables
            module.value_proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(5))
        out_full, _ = full(hidden, tokens)
        out_quantized, _ = quantized(hidden, tokens)
    assert (out_full - out_quantized).abs().max() <= 0.05 * out_full.abs().max()


def test_table_dtype_is_checked():
    with pytest.raises(ConfigError, match=r"table_dtype.*'fp16' is not one of \('fp32', 'bf16', 'fp8'\)"):
        small_config(table_dtype="fp16")


def test_a_table_with_non_finite_values_is_not_quantized():
    weight = torch.randn(10, 4)
    weight[3, 1] = float("nan")
    weight[7, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite values in 2 rows \\(first: row 3\\)"):
        quantize_table(weight, "fp8")
    tiny = torch.full((2, 4), 1e-42)  # the scale of a subnormal row would underflow to zero
    stored = quantize_table(tiny, "fp8")
    assert torch.isfinite(dequantize_rows(stored["weight"], stored["row_scale"])).all()
