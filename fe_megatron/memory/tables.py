"""NgramTables: every branch's table E_b of one layer in a single buffer (Eq. 2 and 6).

The rows are FactorEngram's coefficients z or Engram's dense embeddings; both are addressed
the same way, by n-gram (`fe_megatron.ngram`).  They are stored as ``MemoryConfig.table_dtype``
says (`fe_megatron.tables.storage`): fp32, bf16 or fp8 (for serving, where only the gathered
rows are dequantized).  A table trained by fe_megatron's own optimizer lives in a `TableStore`
(`manage`): device or host memory, outside the module's parameters and buffers.
"""

from typing import Optional

import torch
import torch.nn as nn

from fe_megatron import ops
from fe_megatron.tables.layout import TableLayout
from fe_megatron.tables.storage import ROW_SCALE, STORAGE, dequantize_rows, has_row_scale, quantize_table
from fe_megatron.tables.store import StartedLookup, StoreLookup, TableStore


class NgramTables(nn.Module):
    """``weight``: [total_rows, width]; branch b owns rows ``[offset_b, offset_b + M_b)``; with
    ``table_dtype="fp8"`` also ``row_scale``: [total_rows].

    ``forward(indices)`` gathers all branches in one kernel call and concatenates them in the
    fixed branch order: [..., branches] -> [..., branches * width] (``z_t`` of Eq. 6), in fp32.
    Under tensor parallelism ``width`` is this rank's column slice of ``s_b``, and the result is
    its slice of every branch, branch-major.

    ``weight`` is one of:

    * a parameter: fp32 tables trained by the engine's optimizer (under Megatron's DDP with its
      ``main_grad``; under ZeRO-3 a partitioned parameter, gathered by DeepSpeed around the forward),
      or bf16 and fp8 serving tables (fp8 with ``row_scale`` beside them), which do not require
      gradients;
    * the rows of a `TableStore` (``store``), once `manage` has handed them to one for fe_megatron's
      table optimizer: neither a parameter nor a buffer of the module, so no framework wraps,
      moves, casts, partitions, broadcasts or updates them (``module.to``, ``.bfloat16()``, ZeRO,
      DDP's buffer broadcast).  The state dict still holds them under ``weight``
      (`_save_to_state_dict`, `_load_from_state_dict`) unless the engine saves them itself;
    * an unset placeholder on the meta device (`release_for_mapping`), until a read-only view of a
      checkpoint file is assigned to it (`fe_megatron.hf.mmap_tables`).
    """

    def __init__(self, total_rows: int, width: int, table_dtype: str = "fp32"):
        super().__init__()
        self.table_dtype = table_dtype
        trained = table_dtype == "fp32"  # trained tables take the module's dtype, as every other weight
        self.weight = nn.Parameter(torch.empty(total_rows, width, dtype=None if trained else STORAGE[table_dtype]),
                                   requires_grad=trained)
        if has_row_scale(table_dtype):
            self.row_scale = nn.Parameter(torch.ones(total_rows), requires_grad=False)
        self.store: Optional[TableStore] = None
        self.store_in_state_dict = True

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        if self.weight.is_meta:
            raise RuntimeError("this table's rows are neither in memory nor mapped: table_storage='mmap' maps them "
                               "from a checkpoint directory in from_pretrained (fe_megatron.hf.mmap_tables)")
        if self.store is not None:
            return self.start_lookup(indices, indices.device).rows().flatten(-2)
        if self.table_dtype == "fp32":  # by format, not requires_grad: transformers' loading sets it on every parameter
            return ops.gather_rows(self.weight, indices).flatten(-2)  # [..., nb, w] -> [..., nb * w]
        flat = indices.reshape(-1)
        rows = ops.gather_rows_forward(self.weight, flat)
        scales = self.row_scale.index_select(0, flat) if has_row_scale(self.table_dtype) else None
        return dequantize_rows(rows, scales).reshape(*indices.shape[:-1], -1)

    def start_lookup(self, indices: torch.Tensor, device: torch.device) -> StartedLookup:
        """A lookup of ``indices`` ([..., branches]) in these tables, the rows bound for ``device``: a whole
        `TableStore`'s gather started (`StoreLookup`), or, for tables held by the module, a `TableLookup`
        (gathered when read)."""
        if self.store is not None:
            return StoreLookup(self.store, indices, device)
        return TableLookup(self, indices.to(device))

    @property
    def weight(self) -> torch.Tensor:
        """This table's rows (see the class docstring): the store's, else the parameter or placeholder."""
        store = self.__dict__.get("store")
        if store is not None:
            return store.weight
        for tensors in (self._parameters, self._buffers):
            if "weight" in tensors:
                return tensors["weight"]
        raise AttributeError("weight")

    @weight.setter
    def weight(self, value) -> None:  # reached only when neither a parameter nor a buffer holds the rows
        raise AttributeError("this table's rows are in a TableStore, trained by fe_megatron's table optimizer: "
                             "write them in place (tables.weight.copy_(...)) or with load_state_dict"
                             if self.store is not None else "NgramTables.weight: assign a Parameter")

    @weight.deleter
    def weight(self) -> None:
        raise AttributeError("this table's rows are in a TableStore, trained by fe_megatron's table optimizer; "
                             "they stay there for the module's life")

    def manage(self, placement: str, device=None, in_state_dict: bool = True,
               layout: Optional[TableLayout] = None) -> TableStore:
        """Hand the rows to a `TableStore` in ``placement`` ("device": on ``device``, default where
        they are; "host": host memory), stored as ``table_dtype`` (fp32 or bf16), with ``layout`` (where
        they sit in the whole table); the parameter is dropped.  ``in_state_dict``: whether the module's
        state dict keeps the rows (under the same name), or an engine saves them in files of its own.
        Idempotent.  `fe_megatron.tables.stage_tables.StageTables` calls it, and owns the store."""
        if self.store is not None:
            if layout is not None:
                self.store.layout = layout
            return self.store
        mapped = "weight" in self._buffers  # release_for_mapping: a placeholder, or a view of a checkpoint file
        if self.table_dtype not in ("fp32", "bf16") or mapped:
            what = "mapped from a file (load the model without table_storage=mmap)" if mapped else self.table_dtype
            raise ValueError(f"only fp32 and bf16 tables held in memory can be trained from a store; this one is "
                             f"{what}")
        weight = self.weight.detach().to(STORAGE[self.table_dtype])
        if placement == "device" and device is not None:
            weight = weight.to(device)
        del self._parameters["weight"]
        self.store, self.store_in_state_dict = TableStore(weight, placement, layout), in_state_dict
        return self.store

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.store is not None and self.store_in_state_dict:
            destination[prefix + "weight"] = self.store.weight if keep_vars else self.store.weight.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if self.store is None or not self.store_in_state_dict:
            return
        key = prefix + "weight"
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
        elif not isinstance(state_dict[key], torch.Tensor):
            error_msgs.append(f"{key}: expected a tensor, got {type(state_dict[key]).__name__}")
        elif tuple(state_dict[key].shape) != tuple(self.store.weight.shape):
            error_msgs.append(f"size mismatch for {key}: copying a table of shape {tuple(state_dict[key].shape)}, "
                              f"the shape in the current model is {tuple(self.store.weight.shape)}")
        else:  # in place, also under assign=True: the store keeps its rows' placement and dtype
            with torch.no_grad():
                self.store.weight.copy_(state_dict[key])

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


class TableLookup(StartedLookup):
    """A lookup in tables the module holds itself (a parameter, a bf16 or fp8 serving table, a mapped file):
    nothing travels ahead, so `rows` gathers them when read, and again at each read."""

    def __init__(self, tables: NgramTables, indices: torch.Tensor):
        self.tables, self.indices = tables, indices

    def rows(self) -> torch.Tensor:
        """``[*indices.shape, width]``: a parameter's rows in its dtype (differentiable), a bf16 or fp8 serving
        table's dequantized to fp32."""
        return self.tables(self.indices).unflatten(-1, (self.indices.shape[-1], -1))
