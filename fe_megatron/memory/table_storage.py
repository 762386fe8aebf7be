"""How a layer's tables are stored: ``MemoryConfig.table_dtype``.

* ``fp32``: the training format (the paper's), and the default everywhere;
* ``bf16``: rows rounded to bfloat16 (half the bytes; exact to bf16's 8 significant bits);
* ``fp8``: rows in float8 e4m3 with one fp32 scale per row, ``row = weight.float() * row_scale``;
  the scale maps the row's largest magnitude to e4m3's largest finite value (448), so every
  row keeps 3 mantissa bits relative to its own range (about a quarter of the bytes of fp32).

bf16 and fp8 are serving formats, written by ``fe-convert mcore-to-hf --table-dtype`` and read
by the Hugging Face model, which dequantizes only the rows a step gathers.  `quantize_table` is
the one place a table is quantized (the converter and a quantized model's initialization).
bf16 is also a training format (the DeepSpeed engine's row-sharded tables), whose updates are
written back with `stochastic_round_to_bf16` (`fe_megatron.memory.table_optimizer`).
"""

from __future__ import annotations

import torch

from fe_megatron.config import TABLE_DTYPES

STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
ROW_SCALE = "row_scale"  # the fp8 tables' per-row scales, next to ``weight``


def has_row_scale(table_dtype: str) -> bool:
    return table_dtype == "fp8"


@torch.no_grad()
def quantize_table(weight: torch.Tensor, table_dtype: str) -> dict:
    """``{"weight": stored rows}`` (plus ``"row_scale"`` for fp8) of the fp32 table ``weight``."""
    if table_dtype not in STORAGE:
        raise ValueError(f"table_dtype {table_dtype!r} is not one of {TABLE_DTYPES}")
    weight = weight.detach().float()
    finite = torch.isfinite(weight)
    if not bool(finite.all()):
        rows = (~finite).any(dim=1).nonzero().flatten()
        raise ValueError(f"the table has non-finite values in {rows.numel()} rows (first: row {int(rows[0])}); "
                         "a table with inf or nan cannot be stored in a smaller format")
    if not has_row_scale(table_dtype):
        return {"weight": weight.to(STORAGE[table_dtype])}
    scale = weight.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero (or subnormal) row: scale 1
    stored = (weight / scale.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": stored, ROW_SCALE: scale}


def stochastic_round_to_bf16(values: torch.Tensor, generator: torch.Generator = None) -> torch.Tensor:
    """``values`` (fp32) in bfloat16, rounded up or down at random with the probabilities that make
    the result unbiased: ``E[round(x)] = x``.  Round-to-nearest loses every update smaller than half
    a bf16 step (about ``|x| / 256``), which is most of a table row's Adam updates late in
    training; stochastic rounding keeps them in expectation (FBGEMM's bf16 embedding tables do
    the same).

    bf16 is the top half of an fp32's bits: adding a uniform 16-bit integer to the bottom half and
    truncating rounds the magnitude up with probability (dropped bits) / 2^16.  inf and nan stay."""
    bits = values.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # -65536: 0xFFFF0000


def dequantize_rows(rows: torch.Tensor, row_scales: torch.Tensor = None) -> torch.Tensor:
    """fp32 rows from stored ``rows`` ([M, w]) and, for fp8, their scales ([M])."""
    rows = rows.float()
    return rows if row_scales is None else rows * row_scales.unsqueeze(-1)
