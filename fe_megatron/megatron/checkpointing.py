"""Distributed checkpoints of model, optimizer, scheduler and progress.

Layout: ``<dir>/iter_0000100/`` (a megatron dist checkpoint, torch_dist format) and
``<dir>/latest_checkpointed_iteration.txt``. A checkpoint is written to
``iter_XXXXXXX.tmp`` and renamed only after every rank has finished, then the tracker
file is replaced atomically: an interrupted save never damages the previous checkpoint.
"""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist
from megatron.core import dist_checkpointing

TRACKER = "latest_checkpointed_iteration.txt"


def _state(model_chunks, optimizer, scheduler, iteration, is_loading: bool, distributed_optimizer: bool):
    model = model_chunks[0].module
    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"} if distributed_optimizer else None
    state = {"model": model_sd,
             "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}
    if not is_loading:
        state["scheduler"] = scheduler.state_dict()
        state["iteration"] = iteration
    return state


def save_checkpoint(directory: str, model_chunks, optimizer, scheduler, iteration: int,
                    distributed_optimizer: bool = False) -> str:
    final = os.path.join(directory, f"iter_{iteration:07d}")
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dist_checkpointing.save(_state(model_chunks, optimizer, scheduler, iteration, False, distributed_optimizer), tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tracker_tmp = os.path.join(directory, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as fh:
            fh.write(str(iteration))
        os.replace(tracker_tmp, os.path.join(directory, TRACKER))
    dist.barrier()
    return final


def latest_iteration(directory: str):
    path = os.path.join(directory, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        text = fh.read().strip()
    if not text.isdigit():
        raise ValueError(f"{path}: expected an iteration number, found {text!r}")
    if not os.path.isdir(os.path.join(directory, f"iter_{int(text):07d}")):
        raise FileNotFoundError(f"{path} names iteration {text} but {directory}/iter_{int(text):07d} is missing")
    return int(text)


def load_checkpoint(directory: str, model_chunks, optimizer, scheduler, distributed_optimizer: bool = False) -> int:
    """Load the latest checkpoint under ``directory``; returns its iteration (0 when there is none)."""
    iteration = latest_iteration(directory)
    if iteration is None:
        return 0
    path = os.path.join(directory, f"iter_{iteration:07d}")
    sharded = _state(model_chunks, optimizer, scheduler, iteration, True, distributed_optimizer)
    common = dist_checkpointing.load_common_state_dict(path)
    state = dist_checkpointing.load(sharded, path)
    model_chunks[0].module.load_state_dict(state["model"])
    _disambiguate_saved_param_groups(state["optimizer"], optimizer)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(common["scheduler"])
    return int(common["iteration"])


def _saved_param_group_lists(state) -> list:
    """Every ``param_groups`` list in an optimizer state dict (one per chained optimizer), in order."""
    found = []
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "param_groups" and isinstance(value, list):
                found.append(value)
            else:
                found.extend(_saved_param_group_lists(value))
    return found


def _disambiguate_saved_param_groups(saved_state: dict, optimizer) -> None:
    """Megatron matches saved parameter groups to the optimizer's by (wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr).  Release 0.1.0 told its table group (``table_lr_mult``
    != 1) apart from the norms group by ``max_lr`` alone, so both carried the same keys and such a
    checkpoint could not be loaded.  Groups are built in the same order at every save and load,
    so where a saved list's keys collide, take them from the optimizer's group at the same place."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    current = [inner.optimizer.param_groups for inner in getattr(optimizer, "chained_optimizers", [optimizer])]
    saved = _saved_param_group_lists(saved_state)
    if len(saved) != len(current):
        return
    for saved_groups, current_groups in zip(saved, current):
        keys = [tuple(group.get(key) for key in param_group_identifier_keys) for group in saved_groups]
        if len(set(keys)) == len(keys) or len(saved_groups) != len(current_groups):
            continue
        for saved_group, current_group in zip(saved_groups, current_groups):
            saved_group.update({key: current_group[key] for key in param_group_identifier_keys if key in current_group})
