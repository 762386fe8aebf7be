"""TableLayout: where a rank's part of a table sits in the whole table.

A rank may hold a whole table, its tensor-parallel columns, its row shard (``parallel.table_sharding:
rows``), or both.  The layout says which global rows and columns the local ones are: what the
stochastic rounding of every element is keyed by (`fe_megatron.tables.optimizer`), and what the
checkpoints shard the rows and their per-row optimizer state by.  `fe_megatron.tables.stage_tables.
StageTables` gives each of its tables one, from the memory branch's row partition and column slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TableLayout:
    """Where a (local) table's rows and columns sit in the whole table.  ``row_slices``:
    ``[(global_first_row, rows, local_first_row)]``."""

    table: int  # the table's identity, the same at every layout (its layer index)
    row_slices: tuple
    column_offset: int
    global_width: int

    @classmethod
    def whole(cls, table: int, weight: torch.Tensor) -> "TableLayout":
        return cls(table, ((0, weight.shape[0], 0),), 0, weight.shape[1])

    def global_rows(self) -> torch.Tensor:
        """The global row of every local row ([local rows] int64)."""
        return torch.cat([torch.arange(first, first + rows, dtype=torch.int64) for first, rows, _ in
                          sorted(self.row_slices, key=lambda entry: entry[2])])
