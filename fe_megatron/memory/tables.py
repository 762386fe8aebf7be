"""NgramTables: every branch's table E_b of one layer in a single buffer (Eq. 2 and 6).

The rows are FactorEngram's coefficients z or Engram's dense embeddings; both are addressed
the same way, by n-gram (`fe_megatron.ngram`).  They are stored as ``MemoryConfig.table_dtype``
says (`fe_megatron.memory.table_storage`): fp32, bf16 (trained, or for serving) or fp8 (for
serving), where only the gathered rows are dequantized.
"""

import torch
import torch.nn as nn

from fe_megatron import ops
from fe_megatron.memory.table_storage import ROW_SCALE, STORAGE, dequantize_rows, has_row_scale, quantize_table


class NgramTables(nn.Module):
    """``weight``: [total_rows, width]; branch b owns rows ``[offset_b, offset_b + M_b)``; with
    ``table_dtype="fp8"`` also ``row_scale``: [total_rows].

    ``forward(indices)`` gathers all branches in one kernel call and concatenates them in the
    fixed branch order: [..., branches] -> [..., branches * width] (``z_t`` of Eq. 6), in fp32.
    Under tensor parallelism ``width`` is this rank's column slice of ``s_b``, and the result is
    its slice of every branch, branch-major.  fp8 tables are not trained: their parameters do not
    require gradients.  bf16 tables are differentiable here too (a bf16 gradient); fe-pretrain
    trains them row-sharded, with fp32 gradients and stochastic rounding (`TableAdamW`).
    """

    def __init__(self, total_rows: int, width: int, table_dtype: str = "fp32"):
        super().__init__()
        self.table_dtype = table_dtype
        # fp32 tables take the module's dtype, as every other weight; bf16 ones are trainable too (by
        # `fe_megatron.memory.table_optimizer.TableAdamW`); fp8 ones are for serving only
        self.weight = nn.Parameter(torch.empty(total_rows, width,
                                               dtype=None if table_dtype == "fp32" else STORAGE[table_dtype]),
                                   requires_grad=table_dtype != "fp8")
        if has_row_scale(table_dtype):
            self.row_scale = nn.Parameter(torch.ones(total_rows), requires_grad=False)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        if self.weight.is_meta:
            raise RuntimeError("this table's rows are neither in memory nor mapped: table_storage='mmap' maps them "
                               "from a checkpoint directory in from_pretrained (fe_megatron.hf.mmap_tables)")
        if self.weight.requires_grad:  # fp32, or bf16 rows in fp32 (their gradient is bf16, as the weight)
            return ops.gather_rows(self.weight, indices).flatten(-2).float()  # [..., nb, w] -> [..., nb * w]
        flat = indices.reshape(-1)
        rows = ops.gather_rows_forward(self.weight, flat)
        scales = self.row_scale.index_select(0, flat) if has_row_scale(self.table_dtype) else None
        return dequantize_rows(rows, scales).reshape(*indices.shape[:-1], -1)

    def release_for_mapping(self) -> None:
        """Hold no rows: ``weight`` becomes an unset, non-persistent buffer of the same shape and
        dtype, for a view of a checkpoint file to be assigned to (`fe_megatron.hf.mmap_tables`)."""
        shape, dtype = self.weight.shape, self.weight.dtype
        del self.weight
        self.register_buffer("weight", torch.empty(shape, dtype=dtype, device="meta"), persistent=False)

    @torch.no_grad()
    def store_(self, weight: torch.Tensor) -> None:
        """Store the fp32 rows ``weight`` in this table's format."""
        for name, tensor in quantize_table(weight, self.table_dtype).items():
            getattr(self, "weight" if name == "weight" else ROW_SCALE).copy_(tensor)
