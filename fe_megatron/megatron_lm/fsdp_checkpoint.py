"""Megatron-FSDP checkpoints (``--ckpt-format fsdp_dtensor``) of a run whose tables are in stores.

Megatron-FSDP saves what it shards (the backbone and the memory's dense weights) as torch DCP
DTensors. The tables in stores are not its parameters, and every rank of a row-sharded table holds
other rows, which its writer would take for one replicated tensor. So the tables go beside its
checkpoint, in the same iteration folder, under ``fe_tables/``, written and read by the one table
writer (`fe_megatron.megatron.table_checkpoint`, as the DeepSpeed engine's tables outside ZeRO): a
distributed checkpoint (``torch_dist``) of the tables' rows and of the table optimizer's state, by global
row, under the names of every other checkpoint of the project (``decoder.layers.<i>.memory.tables.weight``).
It reshards as those do, across data-parallel sizes and row splits, and ``fe-convert`` reads it as it reads
a ``torch_dist`` checkpoint (`fe_megatron.convert.megatron_reader`).

The tables are written before Megatron-FSDP's part, and Megatron-LM's trainer moves its tracker
(``latest_checkpointed_iteration.txt``) after its own part: a save interrupted in between leaves
the tracker on the previous checkpoint.

While Megatron-LM writes or reads its part, it sees the optimizer chain without the tables' member
(its ``fsdp_dtensor`` writer reads one optimizer's state), and the model's state dict holds no
table (`TablePlan.tables_in_model_state_dict`).
"""

from __future__ import annotations

import os

import torch

from fe_megatron.checkpoint.files import TRACKER, iteration_dir


def table_member(optimizer):
    """The `TableOptimizer` in Megatron-LM's optimizer chain ``optimizer``."""
    from fe_megatron.megatron import compat
    from fe_megatron.megatron.table_optimizer import TableOptimizer

    members = [m for m in compat.optimizer_members(optimizer) if isinstance(m, TableOptimizer)]
    if len(members) != 1:
        raise RuntimeError(f"expected the tables' member in the optimizer chain, found {len(members)}")
    return members[0]


def without_table_member(optimizer):
    """The chain ``optimizer`` without the tables' member: what Megatron-LM's ``fsdp_dtensor`` writer
    and reader see (they read one optimizer's state, not a chain's)."""
    from fe_megatron.megatron import compat
    from fe_megatron.megatron.table_optimizer import TableOptimizer

    members = [m for m in compat.optimizer_members(optimizer) if not isinstance(m, TableOptimizer)]
    return compat.chained_optimizer_class()(members)


def checkpoint_to_load(args):
    """The iteration folder Megatron-LM's loader reads: ``--load``'s checkpoint, else
    ``--pretrained-checkpoint``'s, at ``--ckpt-step`` or the tracker's iteration (``release`` for a
    release checkpoint); None: nothing to load."""
    for directory in (args.load, getattr(args, "pretrained_checkpoint", None)):
        tracker = os.path.join(directory, TRACKER) if directory is not None else None
        if tracker is None or not os.path.isfile(tracker):
            continue
        if getattr(args, "ckpt_step", None) is not None:
            return iteration_dir(directory, args.ckpt_step)
        with open(tracker) as fh:
            text = fh.read().strip()
        return os.path.join(directory, "release") if text == "release" else iteration_dir(directory, int(text))
    return None


def give_empty_shards_a_state(optimizer) -> None:
    """On torch's Adam (no Apex or Transformer Engine), a parameter whose Megatron-FSDP shard is empty
    on a rank never gets a state there, or keeps the one a checkpoint loaded. Megatron-LM's
    ``fsdp_dtensor`` writer then runs its per-parameter collectives (splitting SwiGLU's ``linear_fc1``,
    the uneven DTensors' metadata) on the other ranks only, and waits forever; and it keeps one rank's
    copy of a parameter's step count, which may be that rank's. Give each such parameter zero moments
    (empty, as its shard) and the step count of the parameters that train."""
    from fe_megatron.megatron import compat

    if not compat.distributed_optimizer_runs_torch_adam():
        return
    for member in compat.optimizer_members(optimizer):
        if not isinstance(member, compat.distributed_optimizer_class()):
            continue
        state = member.optimizer.state
        params = [param for group in member.optimizer.param_groups for param in group["params"]]
        empty = [param for param in params if getattr(param, "_local_tensor", param).numel() == 0]
        empty_ids = {id(param) for param in empty}  # (``in`` would compare tensors by value)
        steps = [float(state[param]["step"]) for param in params
                 if id(param) not in empty_ids and "step" in state.get(param, {})]
        step = max(steps, default=0.0)
        for param in empty:
            state[param] = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param),
                            "step": torch.tensor(step)}


def fsdp_checkpointing(args, tables_beside: bool):
    """``(save, load)`` wrappers of Megatron-LM's ``save_checkpoint`` and ``load_checkpoint``
    (`compat.wrap_trainer_checkpointing`) for ``--ckpt-format fsdp_dtensor``: with ``tables_beside``
    the tables in stores go beside Megatron-FSDP's checkpoint (see the module docstring).

    In every such run, each parameter of the optimizer has a state before Megatron-LM's writer reads
    it (`give_empty_shards_a_state`), and a ``--load`` with no checkpoint to load does not reach
    megatron-core 0.19's ``fsdp_dtensor`` loader, which would build the state dict it loads into anyway,
    and with it step the fresh optimizer once on zero gradients: Adam's step count would then start at
    1, and the run leave the curve of one started without ``--load`` at its second update (as the
    recipes are launched: ``--save`` and ``--load`` the same folder)."""
    from fe_megatron.megatron.table_checkpoint import load_tables, save_tables

    def save(save_checkpoint):
        def save_fsdp_dtensor(iteration, model, optimizer, *rest, **kwargs):
            if optimizer is not None:
                give_empty_shards_a_state(optimizer)
                if tables_beside and not kwargs.get("non_persistent_ckpt", False):
                    save_tables(iteration_dir(args.save, iteration), table_member(optimizer).tables)
                    optimizer = without_table_member(optimizer)
            return save_checkpoint(iteration, model, optimizer, *rest, **kwargs)

        return save_fsdp_dtensor

    def load(load_checkpoint):
        def load_fsdp_dtensor(ddp_model, optimizer, *rest, **kwargs):
            if kwargs.get("load_arg", "load") != "load":
                return load_checkpoint(ddp_model, optimizer, *rest, **kwargs)
            folder = checkpoint_to_load(args)
            if folder is None:
                return 0, 0  # nothing to load (see the docstring), as Megatron-LM's loader then returns
            if not tables_beside or optimizer is None:
                return load_checkpoint(ddp_model, optimizer, *rest, **kwargs)
            result = load_checkpoint(ddp_model, without_table_member(optimizer), *rest, **kwargs)
            # (--pretrained-checkpoint sets args.finetune in the loader: the tables' values, not their state)
            with_optimizer = not (args.no_load_optim or args.finetune)
            load_tables(folder, table_member(optimizer).tables, with_optimizer=with_optimizer)
            return result

        return load_fsdp_dtensor

    return save, load
