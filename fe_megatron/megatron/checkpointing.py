"""Distributed checkpoints of model, optimizer, scheduler and progress.

Layout: ``<dir>/iter_0000100/`` (a megatron dist checkpoint, torch_dist format) and
``<dir>/latest_checkpointed_iteration.txt``. A checkpoint is written to
``iter_XXXXXXX.tmp`` and renamed only after every rank has finished, then the tracker
file is replaced atomically: an interrupted save never damages the previous checkpoint.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

TRACKER = "latest_checkpointed_iteration.txt"


def _state(model_chunks, optimizer, scheduler, iteration, is_loading: bool, distributed_optimizer: bool):
    model = model_chunks[0].module
    model_sd = model.sharded_state_dict()
    # The optimizer chain is [backbone, tables] (memory_layer.py); without the chain's "chained_<i>."
    # key prefix a checkpoint's optimizer states have the same names in every layout.
    metadata = {"chained_optim_avoid_prefix": True}
    if distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
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
    _give_fresh_adam_states_a_step(optimizer)
    sharded = _state(model_chunks, optimizer, scheduler, iteration, True, distributed_optimizer)
    common = dist_checkpointing.load_common_state_dict(path)
    state = dist_checkpointing.load(sharded, path)
    model_chunks[0].module.load_state_dict(state["model"])
    _adapt_single_optimizer_state(state["optimizer"], optimizer)
    with torch.no_grad():  # the distributed optimizer copies into views of the parameters
        optimizer.load_state_dict(state["optimizer"])
    _restore_adam_step_counts(state["optimizer"], optimizer)
    scheduler.load_state_dict(common["scheduler"])
    return int(common["iteration"])


def _torch_optimizer_state(state: dict) -> dict:
    """The part of a Megatron optimizer's state dict that holds ``state`` and ``param_groups``."""
    return state["optimizer"] if "optimizer" in state else state


def _adapt_single_optimizer_state(state: dict, optimizer) -> None:
    """Release 0.1.0 kept the tables in the backbone's optimizer, so its checkpoints hold one
    optimizer's state where today's chain holds two (the backbone, then the tables).  Every
    tensor is found by its name regardless; this moves the step count into each member and
    gives each member its own parameter groups (0.1.0's grouped the tables with the norms when
    their learning rate differed only in ``max_lr``, which no loader can tell apart)."""
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chain) == 1 or all(isinstance(key, int) for key in state):
        return
    legacy = {key: state.pop(key) for key in [k for k in state if not isinstance(k, int)]}
    common_step = _torch_optimizer_state(legacy).get("state", {}).get("common_step")
    for index, member in enumerate(chain):
        loaded = _torch_optimizer_state(state[index])
        if common_step is not None:
            loaded["state"]["common_step"] = common_step
        for group, current in zip(loaded["param_groups"], member.optimizer.param_groups):
            group.update({key: value for key, value in current.items() if key != "params"})


def _torch_adam_members(optimizer) -> list:
    """``(index, member)`` of the chain's distributed optimizers that run torch's own Adam (no Apex
    or Transformer Engine: every CPU machine), whose step count lives in each parameter's state."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    return [(index, member) for index, member in enumerate(getattr(optimizer, "chained_optimizers", [optimizer]))
            if isinstance(member, distrib_optimizer.DistributedOptimizer)]


def _give_fresh_adam_states_a_step(optimizer) -> None:
    """Megatron's distributed optimizer on torch's Adam reads the step count off every parameter's
    state when it builds the state dict that a checkpoint is loaded into, and a freshly built
    optimizer has no state yet: give it zero moments and step 0, which the checkpoint overwrites."""
    for _, member in _torch_adam_members(optimizer):
        for group in member.optimizer.param_groups:
            for param in group["params"]:
                state = member.optimizer.state[param]
                if "step" not in state:
                    state.setdefault("exp_avg", torch.zeros_like(param))
                    state.setdefault("exp_avg_sq", torch.zeros_like(param))
                    state["step"] = torch.tensor(0.0)


def _restore_adam_step_counts(state: dict, optimizer) -> None:
    """The step count a distributed optimizer on torch's Adam saved with its parameter groups, put
    back into every parameter's state (Megatron's loader leaves the count it started from there)."""
    for index, member in _torch_adam_members(optimizer):
        saved = state[index] if len(getattr(optimizer, "chained_optimizers", [optimizer])) > 1 else state
        steps = {group["step"] for group in _torch_optimizer_state(saved)["param_groups"] if "step" in group}
        if len(steps) != 1:
            raise ValueError(f"the checkpoint's optimizer {index} holds step counts {sorted(steps)}; expected one")
        step = float(steps.pop())
        for param_state in member.optimizer.state.values():
            param_state["step"] = torch.tensor(step)
