"""``parallel.table_sharding: rows`` under DeepSpeed: the tables stay outside ZeRO.

The branches are built with their rows sharded over the data-parallel group
(`fe_megatron.memory.row_exchange`; lookups and gradients travel by all-to-all), so each rank
already holds only ``1/N`` of every table.  ZeRO must not partition those shards again (ZeRO-3
would all-gather them for every forward) nor average their gradients (the row exchange already
delivered every rank's gradient to the row's owner).  `RowShardedTables` therefore takes the
tables out of the module tree that DeepSpeed sees and gives them their own AdamW over the local
rows (`fe_megatron.memory.table_optimizer.TableAdamW`), with the learning-rate and weight-decay
multipliers of the optimizer section.

bf16 tables (``memory.table_dtype: bf16``) are trained here: the row exchange adds their
gradients into an fp32 ``main_grad`` beside each shard (autograd sees none), and TableAdamW
writes the updated rows back with stochastic rounding.  Per table parameter a rank then holds 2
bytes of weight, 4 of gradient and 8 of Adam moments (14, against 16 for fp32 tables).

Gradient clipping: DeepSpeed clips its parameters by their own global norm; the tables are clipped
by theirs (summed over the group), each against ``optimizer.clip_grad``.  Megatron's engine clips
everything by one norm, so the two engines agree exactly only while no clipping happens
(docs/deepspeed.md).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fe_megatron.memory import MemoryBranch
from fe_megatron.memory.table_optimizer import TableAdamW


def tables_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"tables_rank_{rank:05d}.pt")


class RowShardedTables:
    """The row-sharded tables of ``model`` (``{name: weight}``, Hugging Face names), detached from
    its module tree, with a TableAdamW over this rank's rows (its rounding seeded by ``seed`` and
    the rank)."""

    def __init__(self, model: torch.nn.Module, optimizer_args, group=None, seed: int = 0):
        self.group = group
        self.weights, self.partitions = {}, {}
        for name, module in list(model.named_modules()):
            if isinstance(module, MemoryBranch) and module.row_partition is not None:
                tables = module._modules.pop("tables")
                # still `branch.tables` for the lookup, but no longer a submodule: not a ZeRO parameter
                module.__dict__["tables"] = tables
                self.weights[f"{name}.tables.weight"] = tables.weight
                self.partitions[f"{name}.tables.weight"] = module.row_partition
        if not self.weights:
            raise ValueError("parallel.table_sharding=rows but the model has no row-sharded memory branch")
        o = optimizer_args
        self.trainable = [w for w in self.weights.values() if w.requires_grad]
        for weight in self.trainable:
            if weight.dtype == torch.bfloat16:  # gradients accumulate in fp32 (`fe_megatron.ops.table_weight_gradient`)
                weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                weight.main_grad_only = True
        self.optimizer = TableAdamW(
            [{"params": self.trainable, "lr_mult": o.table_lr_mult, "wd_mult": o.table_weight_decay_mult}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay * o.table_weight_decay_mult,
            seed=seed * 65536 + dist.get_rank(group))
        self.clip_grad = o.clip_grad

    def numel(self) -> int:
        """Table parameters of the whole model (every rank's rows)."""
        return sum(sum(p.branch_rows) * self.weights[name].shape[1] for name, p in self.partitions.items())

    def step(self) -> float:
        """Average the gradients over the data-parallel ranks (as DeepSpeed averages its own), clip
        them by their global norm, update, and zero them.  Returns that norm (before clipping)."""
        world = dist.get_world_size(self.group)
        squares = torch.zeros((), dtype=torch.float64, device=self.trainable[0].device)
        grads = []
        for weight in self.trainable:
            if TableAdamW.gradient(weight) is None:
                weight.grad = torch.zeros_like(weight)
            grad = TableAdamW.gradient(weight)
            grad.div_(world)
            squares += grad.double().pow(2).sum()
            grads.append(grad)
        dist.all_reduce(squares, group=self.group)  # each rank holds different rows
        norm = float(squares.sqrt())
        if self.clip_grad > 0:
            coefficient = self.clip_grad / (norm + 1e-6)
            if coefficient < 1.0:
                for grad in grads:
                    grad.mul_(coefficient)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for weight in self.trainable:
            if getattr(weight, "main_grad", None) is not None:
                weight.main_grad.zero_()
        return norm

    def save(self, folder: str) -> None:
        """This rank's rows and their optimizer state, in ``folder`` (written to a temporary file
        and renamed, so a crash leaves no half file)."""
        rank = dist.get_rank(self.group)
        state = {"world_size": dist.get_world_size(self.group), "rank": rank,
                 "tables": {name: weight.detach().cpu() for name, weight in self.weights.items()},
                 "optimizer": self.optimizer.state_dict()}
        path = tables_file(folder, rank)
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)

    def load(self, folder: str) -> None:
        """This rank's rows and their AdamW moments from the ``tables_rank_*.pt`` files of
        ``folder``, saved at any number of ranks: the files are memory-mapped and only the rows this
        rank owns under its partition are read (`RowPartition.gather_from`), so a run restarted on
        fewer (or more) nodes continues with the same tables and optimizer state."""
        saved = _read_saved_shards(folder)
        with torch.no_grad():
            for name, weight in self.weights.items():
                weight.copy_(self.partitions[name].gather_from([shard["tables"][name] for shard in saved]))
        names = [name for name, weight in self.weights.items() if weight.requires_grad]
        state = {}
        for index, name in enumerate(names):
            entries = [shard["optimizer"]["state"].get(index) for shard in saved]
            if any(entry is None for entry in entries):
                continue  # saved before the tables' first update
            state[index] = {key: (self.partitions[name].gather_from([entry[key] for entry in entries])
                                  if value.dim() > 0 else value.clone())
                            for key, value in entries[0].items()}  # step: the same scalar on every rank
        self.optimizer.load_state_dict({"state": state, "param_groups": saved[0]["optimizer"]["param_groups"]})


def _read_saved_shards(folder: str) -> list:
    """Every saved rank's ``tables_rank_*.pt`` of ``folder``, memory-mapped, in rank order."""
    first = tables_file(folder, 0)
    if not os.path.isfile(first):
        raise FileNotFoundError(f"{first} is missing: {folder} was not saved with parallel.table_sharding=rows "
                                "(resume with the table sharding it was saved with)")
    shards = [torch.load(first, map_location="cpu", mmap=True, weights_only=True)]
    saved_world = int(shards[0]["world_size"])
    for rank in range(1, saved_world):
        path = tables_file(folder, rank)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: {folder} was saved by {saved_world} ranks and each wrote "
                                    "its rows; the checkpoint is incomplete")
        shards.append(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    return shards
