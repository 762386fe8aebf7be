"""How a layer's tables are stored: ``MemoryConfig.table_dtype``.

* ``fp32``: the training format (the paper's), and the default everywhere;
* ``bf16``: rows rounded to bfloat16 (half the bytes; exact to bf16's 8 significant bits);
* ``fp8``: rows in float8 e4m3 with one fp32 scale per row, ``row = weight.float() * row_scale``;
  the scale maps the row's largest magnitude to e4m3's largest finite value (448), so every
  row keeps 3 mantissa bits relative to its own range (about a quarter of the bytes of fp32).

fp32 and bf16 are training formats: bf16 rows are updated in fp32 and written back with
`fe_megatron.ops.reference.stochastic_round_to_bf16` (`fe_megatron.tables.optimizer`).  bf16 and fp8 are serving
formats too, written by ``fe-convert mcore-to-hf --table-dtype`` and read by the Hugging Face
model, which dequantizes only the rows a step gathers.  `quantize_table` is the one place a table
is quantized (the converter and a quantized model's initialization).
"""

from __future__ import annotations

import hashlib

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


def rounding_keys(key) -> tuple:
    """The two 31-bit keys of the rounding noise (`fe_megatron.ops.reference.counter_noise`) of
    ``key`` (any repr-able value): the same in every process.  A table's updates use ``key`` =
    (seed, table, step, tensor) and each element's global id (row x global width + column), so the
    rounding of an element is the same at every parallel layout and after a resume, with no
    generator state to save."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return tuple(int.from_bytes(digest[i:i + 4], "little") & 0x7FFFFFFF for i in (0, 4))


def dequantize_rows(rows: torch.Tensor, row_scales: torch.Tensor = None) -> torch.Tensor:
    """fp32 rows from stored ``rows`` ([M, w]) and, for fp8, their scales ([M])."""
    rows = rows.float()
    return rows if row_scales is None else rows * row_scales.unsqueeze(-1)
