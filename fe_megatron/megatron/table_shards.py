"""The tables' checkpoint description: every table row slice and its optimizer state, by global row.

One description serves every engine's checkpoint of the tables in stores
(`fe_megatron.tables.stage_tables.StageTables`), as megatron-core's ShardedTensors:

* the Megatron engine and Megatron-LM's trainer with ``torch_dist`` save them inside the model's
  checkpoint: the model's row-sharded tables (`fe_megatron.megatron.memory_layer`) and the table
  optimizer's state (`fe_megatron.megatron.table_optimizer.TableOptimizer.sharded_state_dict`) are
  `row_slices_factory` entries, one per tensor, as Megatron's state dicts hold them;
* the engines whose own checkpoints are not Megatron's (the DeepSpeed engine outside ZeRO, Megatron-FSDP)
  save `sharded_state_dict` in ``fe_tables/`` (`fe_megatron.megatron.table_checkpoint`, the one writer).

The names (the same in every engine, so one reader reads them all):

* ``decoder.layers.<i>.memory.tables.weight``: the rows, ``[global rows, width]``, in the tables' dtype;
* ``optimizer.state.<key>.<table>``: the update rule's state kept per table parameter (``exp_avg``,
  ``exp_avg_sq``), shaped as the table;
* ``optimizer.state.row_<key>.<table>``: its state kept per row (``rowwise_adagrad``'s ``momentum``),
  ``[global rows, 1]`` (`fe_megatron.tables.update_rules.UpdateRule.checkpoint_key`).

Each rank describes the rows it holds, every slice of its `TableLayout` at its global row and columns;
the slices are uneven, so the grid is irregular (``axis_fragmentations=None``). Replicas (ranks holding
the same rows) carry a replica id whose first entry is their rank among the replicas, so the first writes
them; the tensor-parallel ranks of a row hold one per-row value (a row's squares are summed over its
columns), so all but the first columns' rank are replicas of it. Loading reads a rank's rows of the
global tensors, whatever split wrote them: a checkpoint resumes at another data-parallel size, another
row split, and between whole and row-sharded tables.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fe_megatron.tables.update_rules import UpdateRule


def table_name(layout) -> str:
    """The checkpoint name of the table whose `TableLayout` is ``layout``: its memory layer's index, the
    GPT model's name (``fe_tables/`` names every model's tables so)."""
    return f"decoder.layers.{layout.table}.memory.tables.weight"


def state_key(key: str, per_row: bool, table: str) -> str:
    """The checkpoint name of optimizer state ``key`` of table ``table`` (its checkpoint name)."""
    return f"optimizer.state.{UpdateRule.checkpoint_key(key, per_row)}.{table}"


def row_slices(key: str, data: torch.Tensor, layout, global_rows: int, replica_id: tuple,
               per_row: bool = False) -> dict:
    """``{"rows<global first row>": ShardedTensor}``: ``data``'s local rows (``[local rows, width]``, or
    for per-row state ``[local rows]`` or ``[local rows, 1]``), one ShardedTensor per row slice of
    ``layout`` at its global row (and, as the table, at the layout's columns), of the global tensor
    ``key`` with ``global_rows`` rows."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = data.view(-1, 1) if per_row else data
    width = data.shape[1]
    global_shape = (global_rows, 1 if per_row else layout.global_width)
    column = 0 if per_row else layout.column_offset
    return {f"rows{first}": ShardedTensor(key=key, data=data[local:local + rows], dtype=data.dtype,
                                          local_shape=(rows, width), global_shape=global_shape,
                                          global_offset=(first, column), axis_fragmentations=None,
                                          replica_id=replica_id)
            for first, rows, local in layout.row_slices}


def row_slices_factory(key: str, data: torch.Tensor, layout, global_rows: int, replica_id: tuple,
                       per_row: bool = False):
    """`row_slices` as one ShardedTensorFactory: what a Megatron model's or optimizer's sharded state
    dict holds per tensor. It loads back as ``data``'s shape, the slices joined in local order; an
    optimizer's state built from the model's factory (megatron-core's ``optim_state_to_sharding_state``)
    is described by the same slices."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    in_local_order = sorted(layout.row_slices, key=lambda row_slice: row_slice[2])

    def build(key, data, replica_id, flattened_range):
        return row_slices(key, data, layout, global_rows, replica_id, per_row)

    def merge(loaded):
        return torch.cat([loaded[f"rows{first}"] for first, _, _ in in_local_order])

    return ShardedTensorFactory(key, data, build, merge, replica_id)


def replica_ids(tables, store) -> tuple:
    """``(rows, per row)``: the replica ids of ``store``'s rows (and of its state shaped as them), and of
    its per-row state, in ``tables`` (a `StageTables`): whole tables are held alike by every rank of its
    replica group, a rank's row shard is its own, and the tensor-parallel ranks of a row hold one
    per-row value (see the module docstring)."""
    replica = dist.get_rank(tables.replica_group) if tables.replica_group is not None else 0
    column_rank = store.layout.column_offset // store.weight.shape[1]
    return (replica, 0), (replica, column_rank)


def table_state(tables, index: int, table: str, values: dict, entries: tuple, describe=row_slices) -> dict:
    """``{checkpoint key (UpdateRule.checkpoint_key): description}`` of the optimizer state of the
    ``index``-th table of ``tables`` (a `StageTables`, in its optimizer's order), whose checkpoint name is
    ``table``: each ``(key, per_row)`` of ``entries`` (the rule's `UpdateRule.state_layout`, or a layout
    an older checkpoint holds) from ``values[key]``, described by ``describe`` (`row_slices`, or
    `row_slices_factory` for a Megatron optimizer's state dict)."""
    name, store = list(tables.stores.items())[index]
    rows_replica, row_replica = replica_ids(tables, store)
    global_rows = tables.global_rows(name)
    return {UpdateRule.checkpoint_key(key, per_row): describe(state_key(key, per_row, table), values[key],
                                                              store.layout, global_rows,
                                                              row_replica if per_row else rows_replica, per_row)
            for key, per_row in entries}


def sharded_state_dict(tables) -> dict:
    """``tables``' (a `StageTables`) rows, optimizer state and step counts as one sharded state dict, by
    global row (see the module docstring): ``{"tables": {name: slices}, "optimizer": {name: {checkpoint key:
    slices}}, "common": {"steps", "table_steps"}}``. The slices hold the live tensors' rows."""
    optimizer = tables.optimizer
    optimizer.initialize_state()  # zero state before the first update: every table has all its keys
    rows, state, steps = {}, {}, {}
    for index, (stored_name, store) in enumerate(tables.stores.items()):
        name = table_name(store.layout)
        rows_replica, _ = replica_ids(tables, store)
        rows[name] = row_slices(name, store.weight, store.layout, tables.global_rows(stored_name), rows_replica)
        saved = optimizer.state[store.weight]
        state[name] = table_state(tables, index, name, saved, tables.rule.state_layout)
        steps[name] = float(saved["step"])
    return {"tables": rows, "optimizer": state, "common": {"steps": tables.steps, "table_steps": steps}}
