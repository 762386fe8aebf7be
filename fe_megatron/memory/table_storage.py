"""How a layer's tables are stored: ``MemoryConfig.table_dtype``.

* ``fp32``: the training format (the paper's), and the default everywhere;
* ``bf16``: rows rounded to bfloat16 (half the bytes; exact to bf16's 8 significant bits);
* ``fp8``: rows in float8 e4m3 with one fp32 scale per row, ``row = weight.float() * row_scale``;
  the scale maps the row's largest magnitude to e4m3's largest finite value (448), so every
  row keeps 3 mantissa bits relative to its own range (about a quarter of the bytes of fp32).

fp32 and bf16 are training formats: bf16 rows are updated in fp32 and written back with
`stochastic_round_to_bf16` (`fe_megatron.memory.table_optimizer`).  bf16 and fp8 are serving
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


def stochastic_round_to_bf16(values: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``values`` (fp32) in bfloat16, rounded up or down at random with the probabilities that make
    the result unbiased: ``E[round(x)] = x``.  Round-to-nearest loses every update smaller than half
    a bf16 step (about ``|x| / 256``), which is most of a table row's Adam updates late in
    training; stochastic rounding keeps them in expectation (FBGEMM's bf16 embedding tables do
    the same).

    bf16 is the top half of an fp32's bits: adding ``noise`` (uniform integers in ``[0, 2^16)``,
    one per value, e.g. `rounding_noise`) to the bottom half and truncating rounds the magnitude up
    with probability (dropped bits) / 2^16.  Values that are inf or nan are kept as they are."""
    values = values.float().contiguous()
    bits = values.view(torch.int32)
    rounded = ((bits + noise.to(torch.int32)) & -65536).view(torch.float32)  # -65536: 0xFFFF0000
    return torch.where(torch.isfinite(values), rounded, values).to(torch.bfloat16)


_LOW31 = 0x7FFFFFFF


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer hash with full avalanche on 31-bit values (Mueller's 0x45d9f3b mixer); every
    intermediate stays below 2^58, so int64 arithmetic never overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _LOW31
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _LOW31
    return x ^ (x >> 16)


def rounding_noise(key: int, element_ids: torch.Tensor) -> torch.Tensor:
    """Uniform 16-bit integers (int32), one per entry of ``element_ids`` (int64 >= 0), a function of
    ``key`` and the id alone: a counter-based generator.  A table's updates use ``key`` = (table,
    step) and the element's global id (row x global width + column), so the rounding of an element
    is the same at every parallel layout and after a resume, with no generator state to save."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()  # the same in every process
    key1, key2 = (int.from_bytes(digest[i:i + 4], "little") & _LOW31 for i in (0, 4))
    ids = element_ids.to(torch.int64)
    mixed = _mix31(_mix31((ids & _LOW31) ^ key1) ^ (ids >> 31) ^ key2)
    return ((mixed >> 8) & 0xFFFF).to(torch.int32)


def dequantize_rows(rows: torch.Tensor, row_scales: torch.Tensor = None) -> torch.Tensor:
    """fp32 rows from stored ``rows`` ([M, w]) and, for fp8, their scales ([M])."""
    rows = rows.float()
    return rows if row_scales is None else rows * row_scales.unsqueeze(-1)
