"""Who holds a layer's table rows, and the one interface every holder answers.

A layer's tables (`fe_megatron.memory.tables.NgramTables`) read, initialize, hand over and save their rows
through exactly one holder, and never ask which kind it is:

* `EngineParameter`: fp32 rows in a parameter of the module, trained by the engine's optimizer (under
  Megatron's DDP with its ``main_grad``; under ZeRO-3 a partitioned parameter that DeepSpeed gathers around
  the forward).  A lookup is a differentiable gather, done when its rows are read;
* `fe_megatron.tables.store.TableStore`: rows that fe_megatron's table optimizer trains
  (`fe_megatron.tables.stage_tables.StageTables`, the owner of a stage's tables), kept outside the module's
  parameters and buffers;
* `RowShardedRows`: this rank's shard of row-sharded (or node-shared) tables, in a `TableStore` that
  fe_megatron's table optimizer trains; a lookup is a row exchange over the tables' row group
  (`fe_megatron.tables.row_exchange`), which the lookups of every layer sharded over the same group share;
* `ReadOnlyRows`: the serving kinds, which nothing trains: bf16 rows, fp8 rows with one scale per row
  (``row_scale``, `fe_megatron.tables.storage`), or rows mapped from a checkpoint file
  (`fe_megatron.hf.mmap_tables`; until a file is mapped, an unset placeholder).  A lookup gathers the rows and
  dequantizes only those, to fp32.

The interface (``TableStore`` answers it too, all but ``rows_for_store``: its rows are in a store already):

* ``weight``: the rows, [rows, width];
* ``gather(indices)``: the rows of ``indices`` ([..., branches] -> [..., branches, width]), now;
* ``start_lookup(indices, device)``: a started lookup (`fe_megatron.tables.store.StartedLookup`);
* ``initialize(draw)``: fill the rows from ``draw`` (which writes an fp32 or bf16 tensor in place), in the
  holder's format;
* ``rows_for_store()``: the rows, detached, for a `TableStore` to take over (the module then drops its
  parameter), or a ValueError naming why this holder's rows cannot be trained from a store;
* ``outside_module``: the tensors the holder keeps outside the module's parameters and buffers, by name
  (a store's rows), which the module's state dict and the engines' parameter counts add;
* ``exchange_group``: the process group whose ranks own the rows (row-sharded tables), or None: the
  lookups of holders with the same group start together (`start_exchanged_lookups`).

Which holder a table has is decided in one place: `fe_megatron.tables.plan` (`module_holder` for the rows
a module holds; `TablePlan.holder` for a run's), and `NgramTables` builds it (`holder_for`).

The engine's and the serving holders read the module's registered tensors when asked, never a copy:
transformers' loading, DeepSpeed and ``module.to`` replace or move those tensors in place of the holder.
Their started lookups (`ModuleLookup`) gather when read; the branch reads every lookup through the module's
call (``tables(lookup)``), so that what frameworks run around its forward runs: ZeRO-3 gathers a partitioned
parameter there. A lookup goes one way: the module asks its holder, and the holder never calls the module.
"""

from __future__ import annotations

import types

import torch

from typing import Optional

import torch.distributed as dist

from fe_megatron import ops
from fe_megatron.tables.plan import PARAMETER, READ_ONLY
from fe_megatron.tables.row_exchange import RowPartition, StageRowExchange, row_lookup
from fe_megatron.tables.storage import ROW_SCALE, dequantize_rows, has_row_scale
from fe_megatron.tables.store import StartedLookup, TableStore


NOTHING_OUTSIDE = types.MappingProxyType({})  # the rows are the module's own parameter or buffer


def _registered(tables, name: str) -> torch.Tensor:
    """Tensor ``name`` the module ``tables`` holds as a parameter or a buffer."""
    for tensors in (tables._parameters, tables._buffers):
        if name in tensors:
            return tensors[name]
    raise AttributeError(name)


class _ModuleRows:
    """Rows held in the module's own tensors (``tables``: the `NgramTables`), read when asked."""

    outside_module = NOTHING_OUTSIDE
    exchange_group = None

    def __init__(self, tables):
        self.tables = tables

    @property
    def weight(self) -> torch.Tensor:
        return _registered(self.tables, "weight")

    def start_lookup(self, indices: torch.Tensor, device) -> StartedLookup:
        return ModuleLookup(self, indices.to(device))


class EngineParameter(_ModuleRows):
    """fp32 rows in the module's parameter ``weight``, trained by the engine's optimizer."""

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """Differentiable, in the parameter's dtype."""
        return ops.gather_rows(self.weight, indices)

    @torch.no_grad()
    def initialize(self, draw) -> None:
        draw(self.weight)

    def rows_for_store(self) -> torch.Tensor:
        return self.weight.detach()


class ReadOnlyRows(_ModuleRows):
    """Serving rows, in the module's ``weight`` (and, for fp8, ``row_scale``) in the format ``table_dtype``;
    ``mapped``: the rows come from a checkpoint file, mapped by `fe_megatron.hf.mmap_tables` into an unset
    placeholder."""

    def __init__(self, tables, table_dtype: str, mapped: bool = False):
        super().__init__(tables)
        self.table_dtype, self.mapped = table_dtype, mapped

    def row_scales(self, flat: torch.Tensor):
        """The scales of rows ``flat`` (fp8), or None."""
        return _registered(self.tables, ROW_SCALE).index_select(0, flat) if has_row_scale(self.table_dtype) else None

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """The addressed rows gathered in their stored format and dequantized (only they) to fp32."""
        if self.weight.is_meta:
            raise RuntimeError("this table's rows are neither in memory nor mapped: table_storage='mmap' maps them "
                               "from a checkpoint directory in from_pretrained (fe_megatron.hf.mmap_tables)")
        flat = indices.reshape(-1)
        rows = ops.gather_rows_forward(self.weight, flat)
        return dequantize_rows(rows, self.row_scales(flat)).view(*indices.shape, -1)

    @torch.no_grad()
    def initialize(self, draw) -> None:
        if self.mapped:  # the rows come from a file
            return
        if has_row_scale(self.table_dtype):  # drawn in fp32, then stored with each row's scale
            values = torch.empty(self.weight.shape, device=self.weight.device)
            draw(values)
            self.tables.store_(values)
        else:  # bf16 rounded to nearest block by block, by the draw (no fp32 copy of the table)
            draw(self.weight)

    def rows_for_store(self) -> torch.Tensor:
        if self.mapped or self.table_dtype not in ("fp32", "bf16"):
            what = "mapped from a file (load the model without table_storage=mmap)" if self.mapped else self.table_dtype
            raise ValueError(f"only fp32 and bf16 tables held in memory can be trained from a store; this one is "
                             f"{what}")
        return self.weight.detach()


class RowShardedRows:
    """This rank's rows of row-sharded tables (``store``: its shard, trained by fe_megatron's table optimizer),
    split over ``group`` as ``partition`` says. A lookup sends each address to the rank that owns its row and
    receives the rows back (`fe_megatron.tables.row_exchange`); there is no local gather of global rows."""

    def __init__(self, store: TableStore, partition: RowPartition, group: dist.ProcessGroup):
        self.store, self.partition, self.exchange_group = store, partition, group

    @property
    def weight(self) -> torch.Tensor:
        return self.store.weight

    @property
    def outside_module(self) -> dict:
        return self.store.outside_module

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        return self.start_lookup(indices, indices.device).rows()

    def start_lookup(self, indices: torch.Tensor, device) -> StartedLookup:
        """This layer's row exchange, alone (`start_exchanged_lookups` starts one for several layers)."""
        return row_lookup(self.store, indices.to(device), self.partition, self.exchange_group)

    def initialize(self, draw) -> None:
        self.store.initialize(draw)

    def rows_for_store(self) -> torch.Tensor:
        raise ValueError("these tables are row-sharded in a store already")


def start_exchanged_lookups(holders: list, indices: list) -> list:
    """One started lookup per holder in ``holders`` (row-sharded holders of one exchange group), for its
    ``indices``, all in one `StageRowExchange`: one set of all-to-alls whatever the number of layers."""
    groups = {id(holder.exchange_group) for holder in holders}
    if len(groups) != 1 or None in [holder.exchange_group for holder in holders]:
        raise ValueError("one row exchange serves holders of one row group; start the others apart")
    exchange = StageRowExchange([holder.store for holder in holders], list(indices),
                                [holder.partition for holder in holders], holders[0].exchange_group)
    return [exchange.layer_lookup(position) for position in range(len(holders))]


def holder_for(kind: str, tables, table_dtype: str):
    """The holder of kind ``kind`` (`fe_megatron.tables.plan.module_holder`) over the module ``tables``."""
    if kind == PARAMETER:
        return EngineParameter(tables)
    if kind == READ_ONLY:
        return ReadOnlyRows(tables, table_dtype)
    raise ValueError(f"a module holds its rows as {PARAMETER!r} or {READ_ONLY!r}, not {kind!r}")


def store_holder(store: TableStore, partition: Optional[RowPartition] = None,
                 group: Optional[dist.ProcessGroup] = None):
    """The holder of rows a store took over: the store itself, or, for rows sharded over ``group``
    (``partition``), a `RowShardedRows` over it."""
    return store if partition is None else RowShardedRows(store, partition, group)


class ModuleLookup(StartedLookup):
    """A lookup in rows the module holds (the engine's parameter, read-only serving rows): gathered by the
    holder when read, and again at each read (a recomputed layer). The branch reads it through the module's
    call (`fe_megatron.memory.tables.NgramTables.forward`), so that the hooks frameworks put around its
    forward have run (ZeRO-3 gathers a partitioned parameter there)."""

    def __init__(self, holder: _ModuleRows, indices: torch.Tensor):
        self.holder, self.indices = holder, indices

    def rows(self) -> torch.Tensor:
        """``[*indices.shape, width]``: the parameter's rows in its dtype (differentiable), serving rows in fp32."""
        return self.holder.gather(self.indices)
