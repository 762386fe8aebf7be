"""Distributed checkpoints of model, optimizer, scheduler, RNG states and progress.

Layout and guarantees: `fe_megatron.checkpoint` (a Megatron dist checkpoint, torch_dist format,
plus the run's config and a checksum manifest per ``iter_XXXXXXX`` folder, committed by
`fe_megatron.checkpoint.commit` as for every engine).  A load verifies every file first
(`fe_megatron.checkpoint.commit.find_checkpoint`) and names the damaged one.
"""

from __future__ import annotations

import os
import random
import sys

import numpy
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel

from fe_megatron.megatron import compat
from fe_megatron.megatron.patches import PatchScope
from fe_megatron.training import faults
from fe_megatron.checkpoint.commit import agree_on_failure, commit, start_save
from fe_megatron.checkpoint.files import write_run_info
from fe_megatron.training.process_death import die_with_parent

RNG_FILE = "rng_state_rank{rank:05d}.pt"


def _writer_queue_dies_with_trainer() -> None:
    """megatron-core's checkpoint writer collects results through a queue served by a spawned
    ``multiprocessing.Manager`` process, which outlives a trainer killed with SIGKILL (a rank
    killed during a save, or any ``kill -9``): each restart then leaks a ~250 MB process that
    holds the launcher's output pipes open.  Create that queue here, from a manager told to die
    with its parent (Linux only; elsewhere megatron-core creates its own)."""
    if not sys.platform.startswith("linux"):
        return
    import multiprocessing
    from multiprocessing.managers import SyncManager

    def make_queue():
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=die_with_parent)
        return manager.Queue()

    compat.install_checkpoint_writer_queue(make_queue)


def prepare_dist_checkpointing(scope: PatchScope) -> None:
    """What megatron-core's ``dist_checkpointing`` needs before a save or load in any engine's process:
    its writer's queue dying with the trainer (`_writer_queue_dies_with_trainer`), and on a host without
    CUDA the CPU backend (`fe_megatron.megatron.cpu_backend`), which answers its CUDA calls, until
    ``scope`` closes (the Megatron engine's world has it already; the DeepSpeed engine's table
    checkpoints open a scope around each save and load)."""
    from fe_megatron.megatron.cpu_backend import enable_cpu_backend

    _writer_queue_dies_with_trainer()
    enable_cpu_backend(scope=scope)


def _state(model_chunks, optimizer, scheduler, iteration, is_loading: bool, distributed_optimizer: bool):
    """What a checkpoint holds; weights only when ``optimizer`` is None (a converted checkpoint)."""
    model = getattr(model_chunks[0], "module", model_chunks[0])
    model_sd = model.sharded_state_dict()
    if optimizer is None:
        return {"model": model_sd} if is_loading else {"model": model_sd, "iteration": iteration}
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


def rng_state() -> dict:
    """This rank's random states: Python's, NumPy's, torch's (CPU and CUDA) and Megatron's tracker."""
    state = {"python": random.getstate(), "numpy": numpy.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(directory: str, model_chunks, optimizer, scheduler, iteration: int,
                    distributed_optimizer: bool = False, run_info: dict = None, keep: int = 0) -> str:
    """Save ``iteration`` under ``directory`` through `fe_megatron.checkpoint.commit`; ``run_info``
    goes to ``fe_run.json``; ``keep`` > 0 deletes all but the newest ``keep`` checkpoints
    afterwards.  With ``optimizer=None`` only the weights are saved (a converted checkpoint).
    Returns the checkpoint folder."""
    rank = dist.get_rank()
    _writer_queue_dies_with_trainer()
    tmp = start_save(directory, iteration)
    error = None
    try:
        dist_checkpointing.save(_state(model_chunks, optimizer, scheduler, iteration, False, distributed_optimizer),
                                tmp)
        if optimizer is not None:
            torch.save(rng_state(), os.path.join(tmp, RNG_FILE.format(rank=rank)))
        if rank == 0 and run_info is not None:
            write_run_info(tmp, run_info)
        if faults.at("fail_after_save", iteration, rank):
            raise RuntimeError(f"injected fault: fail_after_save@{iteration}:{rank}")
    except Exception as err:  # noqa: BLE001 - any rank's failure must keep the tracker where it is
        error = err
    agree_on_failure(error, tmp, iteration)
    return commit(tmp, directory, iteration, keep)


def refuse_unreadable(folder: str) -> None:
    """A `CheckpointError` naming both releases when the installed megatron-core cannot read ``folder``
    (a checkpoint of a newer megatron-core, `compat.unreadable_checkpoint_problem`)."""
    from fe_megatron.checkpoint.files import CheckpointError, read_run_info

    try:
        written_by = ((read_run_info(folder) or {}).get("stack") or {}).get("megatron-core")
    except (OSError, ValueError):
        written_by = None
    problem = compat.unreadable_checkpoint_problem(folder, written_by)
    if problem is not None:
        raise CheckpointError(problem)


def holds_weights_only(folder: str) -> bool:
    """Whether checkpoint ``folder`` holds the model's weights only (written by ``fe-convert``):
    no optimizer state, no schedule, no random states."""
    refuse_unreadable(folder)
    return "scheduler" not in dist_checkpointing.load_common_state_dict(folder)


def _read_row_states_as_saved(folder: str, optimizer) -> None:
    """Tell each table optimizer how ``folder`` holds rowwise_adagrad's per-row state: one value per
    row, or, in checkpoints written before that, repeated across each row's columns
    (`fe_megatron.megatron.table_optimizer.TableOptimizer.sharded_state_dict`).  ``folder`` None:
    one value per row, as every save writes it."""
    from fe_megatron.megatron.table_optimizer import TableOptimizer

    members = [m for m in compat.optimizer_members(optimizer) if isinstance(m, TableOptimizer)]
    if not members or members[0].tables.plan.update != "rowwise_adagrad":
        return
    repeated = False
    if folder is not None:  # the keys from torch's own metadata (megatron-core 0.19's reader of it fails on torch 2.15)
        import torch.distributed.checkpoint as dcp

        keys = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        repeated = any(key.startswith("optimizer.state.momentum.") for key in keys)
    for member in members:
        member.momentum_layout = "columns" if repeated else "rows"


def _hybrid_model_from_gpt_checkpoint(folder: str, model):
    """The hybrid model's pattern when ``model`` is a hybrid model and ``folder`` was written by the GPT model
    (its run info names no pattern): its state is then pointed at the GPT model's keys. A hybrid checkpoint
    loaded into the GPT model is refused by name; None otherwise."""
    from fe_megatron.checkpoint.files import CheckpointError, read_run_info

    model_section = (((read_run_info(folder) or {}).get("config") or {}).get("model") or {})
    written = model_section.get("hybrid_layer_pattern")
    pattern = getattr(model, "hybrid_layer_pattern", None)
    if written and not pattern:
        raise CheckpointError(f"{folder} was written by the hybrid model (model.hybrid_layer_pattern {written!r}); "
                              "resume it with that pattern: the GPT model cannot read a hybrid checkpoint")
    return pattern if pattern and not written else None


def load_checkpoint(folder: str, model_chunks, optimizer, scheduler, distributed_optimizer: bool = False,
                    restore_rng: bool = True) -> int:
    """Load checkpoint ``folder`` (model, optimizer, schedule, and with ``restore_rng`` this rank's
    random states); returns its iteration.  A weights-only checkpoint (`holds_weights_only`) loads
    the weights, leaves the fresh optimizer and schedule alone and returns 0: training starts there."""
    model = getattr(model_chunks[0], "module", model_chunks[0])
    refuse_unreadable(folder)
    common = dist_checkpointing.load_common_state_dict(folder)
    from_gpt = _hybrid_model_from_gpt_checkpoint(folder, model)
    if "scheduler" not in common:
        sharded = _state(model_chunks, None, None, None, True, False)
        if from_gpt:
            compat.point_hybrid_state_at_gpt_checkpoint(sharded, from_gpt)
        model.load_state_dict(dist_checkpointing.load(sharded, folder)["model"])
        # a mixed-precision optimizer copied the parameters into its fp32 main parameters when it was
        # built; without this its first step would write the initial weights back over the loaded ones
        with torch.no_grad():
            optimizer.reload_model_params()
        return 0
    give_fresh_adam_states_a_step(optimizer)
    _read_row_states_as_saved(folder, optimizer)
    sharded = _state(model_chunks, optimizer, scheduler, None, True, distributed_optimizer)
    if from_gpt:
        compat.point_hybrid_state_at_gpt_checkpoint(sharded, from_gpt)
    state = dist_checkpointing.load(sharded, folder)
    model.load_state_dict(state["model"])
    _adapt_single_optimizer_state(state["optimizer"], optimizer)
    before = compat.adopt_checkpoint_group_values(
        optimizer, [_torch_optimizer_state(member)["param_groups"] for member in _member_states(state["optimizer"],
                                                                                                 optimizer)])
    with torch.no_grad():  # the distributed optimizer copies into views of the parameters
        optimizer.load_state_dict(state["optimizer"])
    _read_row_states_as_saved(None, optimizer)  # and write them by row from now on
    if getattr(scheduler, "override_opt_param_scheduler", False):  # training.schedule_on_resume=config
        compat.restore_group_values(optimizer, before)
    _restore_adam_step_counts(state["optimizer"], optimizer)
    scheduler.load_state_dict(common["scheduler"])
    rng_file = os.path.join(folder, RNG_FILE.format(rank=dist.get_rank()))
    if restore_rng and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    return int(common["iteration"])


def _member_states(state, optimizer) -> list:
    """The loaded state of each member of ``optimizer``'s chain (one member's state is not keyed by index)."""
    members = compat.optimizer_members(optimizer)
    return [state[index] for index in range(len(members))] if len(members) > 1 else [state]


def _torch_optimizer_state(state: dict) -> dict:
    """The part of a Megatron optimizer's state dict that holds ``state`` and ``param_groups``."""
    return state["optimizer"] if "optimizer" in state else state


def _adapt_single_optimizer_state(state: dict, optimizer) -> None:
    """Release 0.1.0 kept the tables in the backbone's optimizer, so its checkpoints hold one
    optimizer's state where today's chain holds two (the backbone, then the tables).  Every
    tensor is found by its name regardless; this moves the step count into each member and
    gives each member its own parameter groups (0.1.0's grouped the tables with the norms when
    their learning rate differed only in ``max_lr``, which no loader can tell apart)."""
    chain = compat.optimizer_members(optimizer)
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
    if not compat.distributed_optimizer_runs_torch_adam():
        return []
    return [(index, member) for index, member in enumerate(compat.optimizer_members(optimizer))
            if isinstance(member, compat.distributed_optimizer_class())]


def give_fresh_adam_states_a_step(optimizer) -> None:
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


def adopt_loaded_adam_step_counts(optimizer) -> None:
    """After Megatron-LM's loader: the step count a distributed optimizer on torch's Adam loaded into its
    parameter groups (where it saves it), put into every parameter's state, where torch's Adam reads it
    (the loader leaves the count `give_fresh_adam_states_a_step` started from there)."""
    for index, member in _torch_adam_members(optimizer):
        steps = {group["step"] for group in member.optimizer.param_groups if "step" in group}
        if steps:
            _put_step_count(index, member, steps)


def _restore_adam_step_counts(state: dict, optimizer) -> None:
    """The step count a distributed optimizer on torch's Adam saved with its parameter groups, put
    back into every parameter's state (Megatron's loader leaves the count it started from there)."""
    for index, member in _torch_adam_members(optimizer):
        saved = _member_states(state, optimizer)[index]
        _put_step_count(index, member, {group["step"] for group in _torch_optimizer_state(saved)["param_groups"]
                                        if "step" in group})


def _put_step_count(index: int, member, steps: set) -> None:
    """The one step count in ``steps`` (the checkpoint's, for chain member ``index``) into every
    parameter's state of ``member``, where torch's Adam reads it."""
    if len(steps) != 1:
        raise ValueError(f"the checkpoint's optimizer {index} holds step counts {sorted(steps)}; expected one")
    step = float(next(iter(steps)))
    for param_state in member.optimizer.state.values():
        param_state["step"] = torch.tensor(step)
