"""The one table writer: the tables in stores and their optimizer state, by global row, in ``fe_tables/``.

The engines whose own checkpoint is not Megatron's distributed checkpoint save a pipeline stage's tables
(`fe_megatron.tables.stage_tables.StageTables`) with `save_tables` and read them with `load_tables`:

* the DeepSpeed engine outside ZeRO (`fe_megatron.deepspeed.tables.StoredTables`), beside DeepSpeed's files;
* Megatron-FSDP under Megatron-LM's trainer (`fe_megatron.megatron_lm.fsdp_checkpoint`), beside its
  ``fsdp_dtensor`` checkpoint.

``fe_tables/`` is a distributed checkpoint in megatron-core's ``torch_dist`` format, in the iteration
folder, holding `fe_megatron.megatron.table_shards.sharded_state_dict`: the same description, under the
same names, as the tables inside a Megatron engine's checkpoint (and Megatron-LM's ``torch_dist`` ones), so
it reshards as they do (another data-parallel size, another row split, whole <-> row-sharded tables), and
`fe_megatron.convert.megatron_reader.DistCheckpoint` reads it as it reads them (``fe-convert``,
``fe-eval``, ``fe-inspect``). Its common part holds the step counts (``steps``, ``table_steps``); the
optimizer's hyperparameters are always the resuming run's.

``fe_tables/`` written by Megatron-FSDP runs before this writer hold the same tensors under the same names,
with the table optimizer's state dict as their common part (its parameter groups, and the step count in
``optimizer.state.common_step``); `load_tables` reads the step count from there.

megatron-core's ``dist_checkpointing`` writes and reads it (not a format of our own): it validates that the
ranks' pieces cover every tensor once. A save goes into the iteration folder the engine is writing (its
``.tmp`` folder, or the folder its tracker names only after the save), so an interrupted save never
replaces a committed checkpoint.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fe_megatron.checkpoint.files import TABLES_BESIDE, CheckpointError, has_tables_beside
from fe_megatron.megatron.checkpointing import prepare_dist_checkpointing
from fe_megatron.megatron.patches import PatchScope
from fe_megatron.megatron.table_shards import sharded_state_dict, table_name

TENSOR_PARTS = ("tables", "optimizer")  # the parts of `sharded_state_dict` that hold tensors


def save_tables(folder: str, tables) -> None:
    """``tables``' rows and optimizer state into ``folder/fe_tables`` (every rank of the default group
    takes part, each writing the rows it holds; ``folder`` is on a file system every rank writes to)."""
    from megatron.core import dist_checkpointing

    target = os.path.join(folder, TABLES_BESIDE)
    if dist.get_rank() == 0:
        os.makedirs(target, exist_ok=True)
    dist.barrier()
    with PatchScope("tables' checkpoint") as scope:  # the Megatron engine's world has these already
        prepare_dist_checkpointing(scope)
        dist_checkpointing.save(sharded_state_dict(tables), target)


def load_tables(folder: str, tables, with_optimizer: bool = True) -> None:
    """The rows (and with ``with_optimizer`` the optimizer state and step counts) of ``folder/fe_tables``
    into ``tables``: each rank's rows under its layout, however many ranks wrote them and however they
    were split. A folder without ``fe_tables/``, or one without this run's tensors, is refused by name."""
    from megatron.core import dist_checkpointing

    source = os.path.join(folder, TABLES_BESIDE)
    if not has_tables_beside(folder):
        raise CheckpointError(f"{folder}: no {TABLES_BESIDE}/ holding the memory tables (a run without memory, or "
                              "with its tables in the engine's own files, wrote it, or its save was interrupted); "
                              "resume from a checkpoint this run's settings wrote, or start without --load")
    described = sharded_state_dict(tables)
    wanted = {part: described[part] for part in (TENSOR_PARTS if with_optimizer else ("tables",))}
    problem = _missing_tensors(source, wanted)
    if problem:
        raise CheckpointError(f"{source}: {problem}")
    targets = {address: piece.data for address, piece in _pieces(wanted).items()}  # the live rows and state
    with PatchScope("tables' checkpoint") as scope:  # the Megatron engine's world has these already
        prepare_dist_checkpointing(scope)
        loaded = dist_checkpointing.load(wanted, source)
    with torch.no_grad():
        for (part, name, key, rows), target in targets.items():
            value = loaded[part][name]
            target.copy_((value[key] if key else value)[rows])
    if with_optimizer:
        _load_steps(loaded, tables)


def _pieces(state: dict) -> dict:
    """``{(part, table, checkpoint key or "", "rows<first>"): ShardedTensor}`` of the tensor parts of
    ``state`` (a `sharded_state_dict`, or some of its parts)."""
    found = {}
    for part in TENSOR_PARTS:
        for name, value in state.get(part, {}).items():
            for key, slices in (value.items() if part == "optimizer" else [("", value)]):
                for rows, piece in slices.items():
                    found[part, name, key, rows] = piece
    return found


def _load_steps(loaded: dict, tables) -> None:
    """The step counts of ``loaded`` (the checkpoint's common part) into ``tables`` and its optimizer's state:
    this writer's ``common``, or the table optimizer's state dict in ``fe_tables/`` of Megatron-FSDP runs
    written before it."""
    common = loaded.get("common") or {}
    if "steps" in common:
        steps, table_steps = int(common["steps"]), dict(common["table_steps"])
    else:
        saved = ((loaded.get("optimizer") or {}).get("state") or {})
        if "common_step" not in saved:
            raise CheckpointError("the tables' checkpoint holds no step count (neither common.steps nor the table "
                                  "optimizer's optimizer.state.common_step): it was not written by fe_megatron's "
                                  "table writer; resume from a checkpoint of this run")
        steps, table_steps = int(saved["common_step"]), {}  # every table's count is the common one
    tables.steps = steps
    for store in tables.stores.values():
        # (a table the common part does not list, of a stage rank 0 does not hold: the stage's count, the same)
        step = table_steps.get(table_name(store.layout), float(steps))
        tables.optimizer.state[store.weight]["step"] = torch.tensor(float(step))


def _missing_tensors(source: str, sharded: dict) -> str:
    """What ``source`` lacks of the tensors ``sharded`` names ("" when nothing): another model's tables,
    or another update rule's state."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(source).read_metadata().state_dict_metadata
    missing = sorted({piece.key for piece in _pieces(sharded).values() if piece.key not in saved})
    if not missing:
        return ""
    return (f"holds no {missing[0]} ({len(missing)} of this run's table tensors are missing); it was saved by "
            "a run with other memory layers or another optimizer.table_update: resume with the settings it was "
            "saved with")
