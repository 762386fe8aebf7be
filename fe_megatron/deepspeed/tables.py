"""The DeepSpeed engine's tables outside ZeRO (`StoredTables`).

``parallel.table_sharding: rows``: the branches are built with their rows sharded over the
data-parallel group (`fe_megatron.tables.row_exchange`; lookups and gradients travel by
all-to-all), so each rank already holds only ``1/N`` of every table.  ZeRO must not partition
those shards again (ZeRO-3 would all-gather them for every forward) nor average their gradients
(the row exchange already delivered every rank's gradient to the row's owner).

``parallel.table_sharding: replicated`` with table stores (bf16 tables, ``table_placement: host``
``optimizer.table_state_dtype: bf16`` or a sparse ``optimizer.table_update``;
`fe_megatron.tables.plan.TablePlan`):
every rank holds whole tables, whose gradients are all-reduced over the ranks.  (With fp32 tables
on the device and fp32 state, ``replicated`` keeps meaning what it always did under this engine:
the tables are ZeRO's parameters, as with ``zero``.)

Either way `StoredTables` trains them with `fe_megatron.tables.stage_tables.StageTables`, as the
Megatron engine trains tables in stores: each table's rows leave the module's parameters for its
store, which no framework moves, casts, partitions or updates, and which DeepSpeed's module
checkpoint leaves out (the rows are saved in a checkpoint of their own, below); in stores on the device
or on the host, their gradients averaged as DeepSpeed averages its own, with `TableAdamW` and the
optimizer section's learning-rate and weight-decay multipliers.

Gradient clipping: one global norm over DeepSpeed's parameters and the tables, as Megatron's
engine clips (`fe_megatron.deepspeed.clipping`: DeepSpeed's norm is widened by the tables').

Checkpoints: the one table writer of every engine whose own files are not Megatron's
(`fe_megatron.megatron.table_checkpoint`, as Megatron-FSDP's): a ``torch_dist`` checkpoint in
``fe_tables/`` beside DeepSpeed's files, by global row, under the Megatron engine's names, which resumes at
any data-parallel size and row split and which ``fe-convert``, ``fe-eval`` and ``fe-inspect`` read as they
read the Megatron engine's.  Checkpoints written before it hold ``tables_rank_NNNNN.pt`` files (one per
rank, rank 0's alone for whole tables); `StoredTables.load` still reads them, at any data-parallel size.
Tables as ZeRO's parameters (``table_sharding: zero``, or ``replicated`` when the plan keeps no table in a
store) are in DeepSpeed's own files, partitioned as every other parameter.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fe_megatron.checkpoint.files import has_tables_beside
from fe_megatron.memory.branch import memory_branches
from fe_megatron.tables.plan import TablePlan
from fe_megatron.tables.stage_tables import StageTables


def tables_file(folder: str, rank: int) -> str:
    """A ``tables_rank_NNNNN.pt`` file of ``folder`` (checkpoints written before ``fe_tables/``)."""
    return os.path.join(folder, f"tables_rank_{rank:05d}.pt")


class StoredTables:
    """The tables of ``model`` (Hugging Face names), trained in stores outside ZeRO as ``plan`` says (on
    ``device``, or the host), by one `StageTables`; ``group``: the data-parallel ranks (default: all)."""

    def __init__(self, model: torch.nn.Module, optimizer_args, plan: TablePlan, device=None, group=None,
                 seed: int = 0):
        self.group = group
        branches = memory_branches(model)
        if not branches:
            raise ValueError("the model has no memory branch whose tables could be kept outside ZeRO")
        self.row_sharded = any(branch.row_partition is not None for branch in branches.values())
        ranks = group if group is not None else dist.group.WORLD
        # whole tables: the ranks are replicas, their gradients summed; row shards: each rank's rows are its own
        self.tables = StageTables(branches, optimizer_args, plan, device,
                                  replica_group=None if self.row_sharded else ranks,
                                  norm_groups=[ranks] if self.row_sharded else [],
                                  gradient_scale=1.0 / dist.get_world_size(ranks), seed=seed)
        self.optimizer = self.tables.optimizer
        self.clip_grad = optimizer_args.clip_grad

    def numel(self) -> int:
        """Table parameters of the whole model (every rank's rows)."""
        return self.tables.numel()

    def step(self, norm: float = None) -> float:
        """Average the gradients over the data-parallel ranks (as DeepSpeed averages its own), clip
        them by ``norm`` (the global norm of every gradient, `fe_megatron.deepspeed.clipping`;
        default: the tables' own), update, and zero them.  Returns the norm clipped by."""
        if norm is None:
            norm = self.tables.grad_norm()
        self.tables.clip_and_step(self.clip_grad, norm)  # as Megatron's engine clips and steps them
        self.tables.zero_grad()
        return norm

    def save(self, folder: str) -> None:
        """The rows and their optimizer state, by global row, in ``folder``'s ``fe_tables/``: the one
        table writer (`fe_megatron.megatron.table_checkpoint`); every rank takes part, each writing the rows
        it holds (whole tables: the first rank)."""
        from fe_megatron.megatron.table_checkpoint import save_tables

        save_tables(folder, self.tables)

    def load(self, folder: str) -> None:
        """The rows and their optimizer state from ``folder``, saved at any number of ranks and row
        split: from its ``fe_tables/`` (the one table writer's), or, for a checkpoint written before the
        engines shared that format, from its ``tables_rank_*.pt`` files (`load_rank_files`)."""
        if has_tables_beside(folder):
            from fe_megatron.megatron.table_checkpoint import load_tables

            load_tables(folder, self.tables)
        else:
            self.load_rank_files(folder)

    def load_rank_files(self, folder: str) -> None:
        """The rows and their moments from the ``tables_rank_*.pt`` files of ``folder`` (one per rank
        under ``rows``, rank 0's alone for whole tables: what this engine wrote before its tables were
        saved as every engine's), saved at any number of ranks: the files are memory-mapped and only the
        rows this rank owns under its partition are read (`RowPartition.gather_from`)."""
        saved = _read_saved_shards(folder)
        if bool(saved[0].get("row_sharded", True)) != self.row_sharded:
            raise ValueError(f"{folder} holds {'row-sharded' if self.row_sharded else 'whole'} tables' files "
                             f"written for the other table sharding; resume with the sharding it was saved with")

        def mine(name: str, tensors: list) -> torch.Tensor:
            partition = self.tables.partitions[name]
            return partition.gather_from(tensors) if partition is not None else tensors[0]

        with torch.no_grad():
            for name, store in self.tables.stores.items():
                store.weight.copy_(mine(name, [shard["tables"][name] for shard in saved]))
        state = {}
        for index, name in enumerate(self.tables.stores):
            entries = [shard["optimizer"]["state"].get(index) for shard in saved]
            if any(entry is None for entry in entries):
                continue  # saved before the tables' first update
            state[index] = {key: (mine(name, [entry[key] for entry in entries]) if value.dim() > 0 else value.clone())
                            for key, value in entries[0].items()}  # step: the same scalar on every rank
        # the moments and step counts from the files, the hyperparameters (multipliers, betas, eps) from this run
        groups = [dict(group, params=list(range(len(group["params"])))) for group in self.optimizer.state_dict()[
            "param_groups"]]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _read_saved_shards(folder: str) -> list:
    """Every saved rank's ``tables_rank_*.pt`` of ``folder``, memory-mapped, in rank order."""
    first = tables_file(folder, 0)
    if not os.path.isfile(first):
        raise FileNotFoundError(f"{first} is missing: {folder} was saved with the tables as ZeRO parameters "
                                "(parallel.table_sharding zero); resume with the table sharding it was saved with")
    shards = [torch.load(first, map_location="cpu", mmap=True, weights_only=True)]
    saved_world = int(shards[0]["world_size"])
    for rank in range(1, saved_world):
        path = tables_file(folder, rank)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {folder} was saved by {saved_world} ranks and each wrote "
                                    "its rows; the checkpoint is incomplete")
        shards.append(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    return shards
