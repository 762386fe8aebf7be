"""The tables' checkpoint by global row: one format for the tables of every engine.

A pipeline stage's tables in stores (`fe_megatron.tables.stage_tables.StageTables`) are saved as a
distributed checkpoint in megatron-core's ``torch_dist`` format, in the folder ``fe_tables/`` of the
iteration folder, under the names the Megatron engine's checkpoints give them:

* ``decoder.layers.<i>.memory.tables.weight``: the rows, ``[global rows, width]``, in the tables' dtype;
* ``optimizer.state.<key>.decoder.layers.<i>.memory.tables.weight``: the update rule's state kept per
  table parameter (``exp_avg``, ``exp_avg_sq``), shaped as the table;
* ``optimizer.state.row_<key>.decoder.layers.<i>.memory.tables.weight``: its state kept per row
  (``rowwise_adagrad``'s ``momentum``), ``[global rows, 1]``
  (`fe_megatron.tables.update_rules.UpdateRule.checkpoint_key`);
* in the checkpoint's common part, the step counts.

Each rank writes the rows it holds, every slice at its global row (`TableLayout.row_slices`); tables
held whole by every replica are written once, by the first replica.  Loading reads a rank's rows of
the global tensors, whatever split wrote them, so a checkpoint resumes at another data-parallel size
and another row split; `fe_megatron.convert.megatron_reader.DistCheckpoint` reads it as it reads the
Megatron engine's checkpoints (``fe-convert``, ``fe-eval``, ``fe-inspect``).

megatron-core's ``dist_checkpointing`` writes and reads it (not a format of our own): it is what the
Megatron engine's checkpoints are, and it validates that the ranks' pieces cover every tensor once.
The DeepSpeed engine writes its tables this way (`fe_megatron.deepspeed.tables.StoredTables`), with
megatron-core prepared as the Megatron engine prepares it (`prepare_dist_checkpointing`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fe_megatron.checkpoint.files import TABLES_BESIDE, CheckpointError
from fe_megatron.megatron.checkpointing import prepare_dist_checkpointing
from fe_megatron.tables.update_rules import UpdateRule


def table_name(layout) -> str:
    """The checkpoint name of the table whose `TableLayout` is ``layout`` (its layer's index)."""
    return f"decoder.layers.{layout.table}.memory.tables.weight"


def _pieces(key: str, tensor: torch.Tensor, layout, global_rows: int, replica: tuple, per_row: bool) -> list:
    """``tensor``'s local rows (``[local rows, width]``, or ``[local rows]`` for per-row state) as one
    ShardedTensor per row slice of ``layout``, each at its global row."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = tensor.view(-1, 1) if per_row else tensor
    width = data.shape[1]
    global_shape = (global_rows, 1 if per_row else layout.global_width)
    column = 0 if per_row else layout.column_offset
    return [ShardedTensor(key=key, data=data[local:local + rows], dtype=data.dtype, local_shape=(rows, width),
                          global_shape=global_shape, global_offset=(first, column), axis_fragmentations=None,
                          replica_id=replica)
            for first, rows, local in layout.row_slices]


def sharded_state_dict(tables) -> dict:
    """``tables``' (a `StageTables`) rows, optimizer state and step counts as megatron-core's sharded
    state dict (see the module docstring); the ShardedTensors hold the live tensors' rows."""
    optimizer = tables.optimizer
    optimizer.initialize_state()  # zero state before the first update: every table has all its keys
    replicated = tables.replica_group is not None
    replica_index = dist.get_rank(tables.replica_group) if replicated else 0
    rows, state, steps = {}, {}, {}
    entries = tables.rule.state
    for stored_name, store in tables.stores.items():
        layout = store.layout
        name = table_name(layout)
        global_rows = tables.global_rows(stored_name)
        column_rank = layout.column_offset // store.weight.shape[1]
        # a rank's columns are its own; whole tables are held alike by every replica, the first writes them
        rows[name] = _pieces(name, store.weight, layout, global_rows, (replica_index, 0), False)
        saved = optimizer.state[store.weight]
        for entry in entries:
            key = f"optimizer.state.{UpdateRule.checkpoint_key(entry.key, entry.per_row)}.{name}"
            # per-row state: the tensor-parallel ranks of a row hold one value (the squares of the whole row)
            replica = (replica_index, column_rank if entry.per_row else 0)
            state[key] = _pieces(key, saved[entry.key], layout, global_rows, replica, entry.per_row)
        steps[name] = float(saved["step"])
    return {"tables": rows, "optimizer": state, "common": {"steps": tables.steps, "table_steps": steps}}


def save_tables(folder: str, tables) -> None:
    """``tables``' rows and optimizer state into ``folder/fe_tables`` (every rank of the default group
    takes part; ``folder`` is on a file system every rank writes to)."""
    from megatron.core import dist_checkpointing

    prepare_dist_checkpointing()
    target = os.path.join(folder, TABLES_BESIDE)
    if dist.get_rank() == 0:
        os.makedirs(target, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sharded_state_dict(tables), target)


def load_tables(folder: str, tables) -> None:
    """The rows and optimizer state of ``folder/fe_tables`` into ``tables`` (each rank's rows under its
    layout, however many ranks wrote them); the optimizer's hyperparameters stay this run's."""
    from megatron.core import dist_checkpointing

    prepare_dist_checkpointing()
    source = os.path.join(folder, TABLES_BESIDE)
    sharded = sharded_state_dict(tables)
    problem = _missing_tensors(source, sharded)
    if problem:
        raise CheckpointError(f"{source}: {problem}")
    targets = {key: [piece.data for piece in pieces] for part in ("tables", "optimizer")
               for key, pieces in sharded[part].items()}
    loaded = dist_checkpointing.load(sharded, source)
    with torch.no_grad():
        for part in ("tables", "optimizer"):
            for key, pieces in loaded[part].items():
                for target, piece in zip(targets[key], pieces):
                    target.copy_(piece)
    common = loaded["common"]
    tables.steps = int(common["steps"])
    for store in tables.stores.values():
        tables.optimizer.state[store.weight]["step"] = torch.tensor(float(common["table_steps"][table_name(
            store.layout)]))


def _missing_tensors(source: str, sharded: dict) -> str:
    """What ``source`` lacks of the tensors ``sharded`` names ("" when nothing): another model's tables,
    or another update rule's state."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(source).read_metadata().state_dict_metadata
    missing = sorted(key for part in ("tables", "optimizer") for key in sharded[part] if key not in saved)
    if not missing:
        return ""
    return (f"holds no {missing[0]} ({len(missing)} of this run's table tensors are missing); it was saved by "
            "a run with other memory layers or another optimizer.table_update: resume with the settings it was "
            "saved with")
