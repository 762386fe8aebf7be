"""NgramTables: every branch's table E_b of one layer in a single buffer (Eq. 2 and 6).

The rows are FactorEngram's coefficients z or Engram's dense embeddings; both are addressed
the same way, by n-gram (`fe_megatron.ngram`).  They are stored as ``MemoryConfig.table_dtype``
says (`fe_megatron.tables.storage`): fp32, bf16 or fp8 (for serving, where only the gathered
rows are dequantized).  One holder (`fe_megatron.tables.holders`) keeps them: the engine's parameter,
a `TableStore` that fe_megatron's table optimizer trains (`manage`), or read-only serving rows; the
module asks it and never which kind it is.
"""

from typing import Optional

import torch
import torch.nn as nn

from fe_megatron.tables.holders import ReadOnlyRows, holder_for, store_holder
from fe_megatron.tables.layout import TableLayout
from fe_megatron.tables.plan import PARAMETER, module_holder
from fe_megatron.tables.row_exchange import RowPartition
from fe_megatron.tables.storage import STORAGE, has_row_scale, quantize_table
from fe_megatron.tables.store import StartedLookup, TableStore


class NgramTables(nn.Module):
    """``weight``: [total_rows, width]; branch b owns rows ``[offset_b, offset_b + M_b)``; with
    ``table_dtype="fp8"`` also ``row_scale``: [total_rows].

    ``forward(lookup)`` reads a started lookup's rows (all branches in one kernel call) and concatenates
    them in the fixed branch order: [..., branches] -> [..., branches * width] (``z_t`` of Eq. 6), in fp32;
    ``gather(indices)`` does the same for indices, now.
    Under tensor parallelism ``width`` is this rank's column slice of ``s_b``, and the result is
    its slice of every branch, branch-major.

    ``holder`` (`fe_megatron.tables.holders`) holds the rows, and ``weight`` is its rows:

    * `EngineParameter` for fp32 tables: a parameter the engine's optimizer trains (under Megatron's
      DDP with its ``main_grad``; under ZeRO-3 a partitioned parameter, gathered by DeepSpeed around
      the forward);
    * a `TableStore` (also ``store``), once `manage` has handed the rows to one for fe_megatron's
      table optimizer: neither a parameter nor a buffer of the module, so no framework wraps,
      moves, casts, partitions, broadcasts or updates them (``module.to``, ``.bfloat16()``, ZeRO,
      DDP's buffer broadcast).  The state dict still holds them under ``weight``
      (`_save_to_state_dict`, `_load_from_state_dict`) unless the engine saves them itself;
    * `ReadOnlyRows` for bf16 and fp8 tables no store has taken (serving; fp8 with ``row_scale``
      beside them), and for tables released for a checkpoint file's mapping (`release_for_mapping`,
      `fe_megatron.hf.mmap_tables`).  These do not require gradients.
    """

    def __init__(self, total_rows: int, width: int, table_dtype: str = "fp32"):
        super().__init__()
        self.table_dtype = table_dtype
        kind = module_holder(table_dtype)  # the plan decides (fe_megatron.tables.plan)
        trained = kind == PARAMETER
        self.holder = holder_for(kind, self, table_dtype)
        # trained tables take the module's dtype, as every other weight
        self.weight = nn.Parameter(torch.empty(total_rows, width, dtype=None if trained else STORAGE[table_dtype]),
                                   requires_grad=trained)
        if has_row_scale(table_dtype):  # fp32 whatever the default dtype a loader builds the model under
            self.row_scale = nn.Parameter(torch.ones(total_rows, dtype=torch.float32), requires_grad=False)
        self.store: Optional[TableStore] = None
        self.store_in_state_dict = True

    def forward(self, lookup: StartedLookup) -> torch.Tensor:
        """The rows of a started ``lookup`` (`start_lookup`), concatenated: [..., nb, w] -> [..., nb * w].
        Read through the module's call, so that what frameworks run around its forward runs (ZeRO-3 gathers
        a partitioned parameter there); the lookup then reads its holder, and nothing calls back."""
        return lookup.rows().flatten(-2)

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """The rows of ``indices`` ([..., branches]) gathered now, concatenated ([..., nb * w]), outside any
        framework's hooks (serving, tests)."""
        return self.holder.gather(indices).flatten(-2)

    def start_lookup(self, addresses: torch.Tensor, device: torch.device) -> StartedLookup:
        """A lookup of ``addresses`` ([..., branches] row indices) in these tables, the rows bound for ``device``:
        the holder's (`fe_megatron.tables.holders`): a whole `TableStore`'s gather started, for rows the module
        holds a `ModuleLookup` (gathered when read), or, for row-sharded rows, their exchange. Read it with
        ``self(lookup)``."""
        return self.holder.start_lookup(addresses, device)

    @property
    def exchange_group(self):
        """The row group whose ranks own these tables' rows (row-sharded tables), or None: lookups of tables
        with the same group start in one exchange (`fe_megatron.memory.inputs.start_lookups`)."""
        return self.holder.exchange_group

    @property
    def weight(self) -> torch.Tensor:
        """This table's rows (see the class docstring): the holder's."""
        holder = self.__dict__.get("holder")
        if holder is None:
            raise AttributeError("weight")
        return holder.weight

    @weight.setter
    def weight(self, value) -> None:  # reached only when neither a parameter nor a buffer holds the rows
        raise AttributeError("this table's rows are in a TableStore, trained by fe_megatron's table optimizer: "
                             "write them in place (tables.weight.copy_(...)) or with load_state_dict"
                             if self.store is not None else "NgramTables.weight: assign a Parameter")

    @weight.deleter
    def weight(self) -> None:
        raise AttributeError("this table's rows are in a TableStore, trained by fe_megatron's table optimizer; "
                             "they stay there for the module's life")

    @torch.no_grad()
    def initialize(self, draw) -> None:
        """Fill the rows from ``draw`` (a function writing an fp32 or bf16 tensor in place), in this table's
        format; rows mapped from a file are left alone."""
        self.holder.initialize(draw)

    def manage(self, placement: str, device=None, in_state_dict: bool = True,
               layout: Optional[TableLayout] = None, partition: Optional[RowPartition] = None,
               row_group=None) -> TableStore:
        """Hand the rows to a `TableStore` in ``placement`` ("device": on ``device``, default where
        they are; "host": host memory), stored as ``table_dtype`` (fp32 or bf16), with ``layout`` (where
        they sit in the whole table); the parameter is dropped.  ``in_state_dict``: whether the module's
        state dict keeps the rows (under the same name), or an engine saves them in files of its own.
        ``partition``: these rows are this rank's shard of tables row-sharded over ``row_group``, looked up
        by row exchange (`fe_megatron.tables.holders.RowShardedRows`).
        Idempotent.  `fe_megatron.tables.stage_tables.StageTables` calls it, and owns the store."""
        if self.store is not None:
            if layout is not None:
                self.store.layout = layout
            if partition is not None:  # rows a store took whole are now this rank's shard of row-sharded tables
                self.holder = store_holder(self.store, partition, row_group)
            return self.store
        weight = self.holder.rows_for_store().to(STORAGE[self.table_dtype])
        if placement == "device" and device is not None:
            weight = weight.to(device)
        del self._parameters["weight"]
        self.store, self.store_in_state_dict = TableStore(weight, placement, layout), in_state_dict
        self.holder = store_holder(self.store, partition, row_group)
        return self.store

    def _in_state_dict(self) -> dict:
        """The holder's tensors outside the module that its state dict holds."""
        return self.holder.outside_module if self.store_in_state_dict else {}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, tensor in self._in_state_dict().items():
            destination[prefix + name] = tensor if keep_vars else tensor.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for name, tensor in self._in_state_dict().items():
            key = prefix + name
            if key in unexpected_keys:
                unexpected_keys.remove(key)
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
            elif not isinstance(state_dict[key], torch.Tensor):
                error_msgs.append(f"{key}: expected a tensor, got {type(state_dict[key]).__name__}")
            elif tuple(state_dict[key].shape) != tuple(tensor.shape):
                error_msgs.append(f"size mismatch for {key}: copying a table of shape {tuple(state_dict[key].shape)}, "
                                  f"the shape in the current model is {tuple(tensor.shape)}")
            else:  # in place, also under assign=True: the holder keeps its rows' placement and dtype
                with torch.no_grad():
                    tensor.copy_(state_dict[key])

    def release_for_mapping(self) -> None:
        """Hold no rows: ``weight`` becomes an unset, non-persistent buffer of the same shape and
        dtype, for a view of a checkpoint file to be assigned to (`fe_megatron.hf.mmap_tables`); the
        rows are read-only from then on."""
        shape, dtype = self.weight.shape, self.weight.dtype
        del self.weight
        self.register_buffer("weight", torch.empty(shape, dtype=dtype, device="meta"), persistent=False)
        self.holder = ReadOnlyRows(self, self.table_dtype, mapped=True)

    @torch.no_grad()
    def store_(self, weight: torch.Tensor) -> None:
        """Store the fp32 rows ``weight`` in this table's format."""
        for name, tensor in quantize_table(weight, self.table_dtype).items():  # "weight", and fp8's "row_scale"
            getattr(self, name).copy_(tensor)
