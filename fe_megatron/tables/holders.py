"""Who holds a layer's table rows, and the one interface every holder answers.

A layer's tables (`fe_megatron.memory.tables.NgramTables`) read, initialize, hand over and save their rows
through exactly one holder, and never ask which kind it is:

* `EngineParameter`: fp32 rows in a parameter of the module, trained by the engine's optimizer (under
  Megatron's DDP with its ``main_grad``; under ZeRO-3 a partitioned parameter that DeepSpeed gathers around
  the forward).  A lookup is a differentiable gather, done when its rows are read;
* `fe_megatron.tables.store.TableStore`: rows that fe_megatron's table optimizer trains
  (`fe_megatron.tables.stage_tables.StageTables`, the owner of a stage's tables), kept outside the module's
  parameters and buffers;
* `ReadOnlyRows`: the serving kinds, which nothing trains: bf16 rows, fp8 rows with one scale per row
  (``row_scale``, `fe_megatron.tables.storage`), or rows mapped from a checkpoint file
  (`fe_megatron.hf.mmap_tables`; until a file is mapped, an unset placeholder).  A lookup gathers the rows and
  dequantizes only those, to fp32.

The interface (``TableStore`` answers it too, all but ``rows_for_store``: its rows are in a store already):

* ``weight``: the rows, [rows, width];
* ``gather(indices)``: the rows of ``indices`` ([..., branches] -> [..., branches, width]), now (the module's
  forward);
* ``start_lookup(indices, device)``: a started lookup (`fe_megatron.tables.store.StartedLookup`);
* ``initialize(draw)``: fill the rows from ``draw`` (which writes an fp32 or bf16 tensor in place), in the
  holder's format;
* ``rows_for_store()``: the rows, detached, for a `TableStore` to take over (the module then drops its
  parameter), or a ValueError naming why this holder's rows cannot be trained from a store;
* ``outside_module``: the tensors the holder keeps outside the module's parameters and buffers, by name
  (a store's rows), which the module's state dict and the engines' parameter counts add.

The engine's and the serving holders read the module's registered tensors when asked, never a copy:
transformers' loading, DeepSpeed and ``module.to`` replace or move those tensors in place of the holder.
Their started lookups (`ModuleLookup`) read the rows by calling the module, so that what frameworks run
around its forward runs: ZeRO-3 gathers a partitioned parameter there.
"""

from __future__ import annotations

import types

import torch

from fe_megatron import ops
from fe_megatron.tables.storage import ROW_SCALE, dequantize_rows, has_row_scale
from fe_megatron.tables.store import StartedLookup


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

    def __init__(self, tables):
        self.tables = tables

    @property
    def weight(self) -> torch.Tensor:
        return _registered(self.tables, "weight")

    def start_lookup(self, indices: torch.Tensor, device) -> StartedLookup:
        return ModuleLookup(self.tables, indices.to(device))


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


class ModuleLookup(StartedLookup):
    """A lookup in rows the module holds (the engine's parameter, read-only serving rows): gathered when read,
    and again at each read (a recomputed layer), by calling the module (``tables(indices)``), so that the hooks
    frameworks put around its forward run (ZeRO-3 gathers a partitioned parameter there)."""

    def __init__(self, tables, indices: torch.Tensor):
        self.tables, self.indices = tables, indices

    def rows(self) -> torch.Tensor:
        """``[*indices.shape, width]``: the parameter's rows in its dtype (differentiable), serving rows in fp32."""
        return self.tables(self.indices).unflatten(-1, (self.indices.shape[-1], -1))
