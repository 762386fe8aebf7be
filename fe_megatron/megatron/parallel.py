"""Process groups and seeding for megatron.core, from torchrun's or SLURM's environment, and the
patches a Megatron world needs for as long as it lives.

`initialize` opens a `fe_megatron.megatron.patches.PatchScope` and installs into it what megatron-core
needs of this process: on a host without CUDA the CPU backend (`fe_megatron.megatron.cpu_backend`), and
Megatron's fused accumulation of the tables' gradients into ``main_grad``
(`fe_megatron.megatron.main_grad`).  `shutdown` closes it: after fe-pretrain's Megatron engine, a test's
world (the ``megatron_world`` fixture) or a converter's, torch and megatron-core are as they were.
"""

from __future__ import annotations

import os
import random
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from fe_megatron.megatron.cpu_backend import enable_cpu_backend
from fe_megatron.megatron.main_grad import use_main_grad_accumulation
from fe_megatron.megatron.patches import PatchScope
from fe_megatron.training.distributed import destroy_process_groups, init_process_group, launcher_environment

_world_patches: Optional[PatchScope] = None  # opened by the first `initialize`, closed by `shutdown`


def initialize(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, seed: int = 1234,
               context_parallel_size: int = 1, expert_parallel_size: int = 1,
               timeout_minutes: float = 10.0) -> None:
    """Start torch.distributed (nccl on GPU, gloo on CPU), megatron's groups and its RNG streams.
    Every group's collectives fail after ``timeout_minutes`` without their peers.

    ``expert_parallel_size`` is an MoE backbone's; the tables' rows are sharded over their own group,
    `table_row_group`, whatever it is.  Runs single-process when no launcher variables are set.
    The world's patches (`world_patches`) last until `shutdown`; if this fails, they are undone now.
    """
    opened = _world_patches is None
    world_patches()
    try:
        _initialize(tensor_parallel_size, pipeline_parallel_size, seed, context_parallel_size,
                    expert_parallel_size, timeout_minutes)
    except BaseException:
        if opened:
            close_world_patches()
        raise


def world_patches() -> PatchScope:
    """The scope of this process's Megatron world, with the CPU backend (on a host without CUDA) and
    Megatron's gradient accumulation in it: opened by the first call (the first `initialize`; another one
    before `shutdown`, such as a second run set up in the same world, shares it)."""
    global _world_patches
    if _world_patches is None:
        _world_patches = PatchScope("megatron world").open()
        enable_cpu_backend(scope=_world_patches)
        use_main_grad_accumulation(_world_patches)
    return _world_patches


def close_world_patches() -> None:
    """Undo the world's patches (nothing where none are installed)."""
    global _world_patches
    scope, _world_patches = _world_patches, None
    if scope is not None:
        scope.close()


def _initialize(tensor_parallel_size, pipeline_parallel_size, seed, context_parallel_size,
                expert_parallel_size, timeout_minutes) -> None:
    launcher_environment()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        init_process_group("nccl" if on_gpu else "gloo", timeout_minutes)
    world = dist.get_world_size()
    model_parallel = tensor_parallel_size * pipeline_parallel_size * context_parallel_size
    if world % model_parallel:
        raise ValueError(f"world size {world} is not divisible by TP x PP x CP = {tensor_parallel_size} x "
                         f"{pipeline_parallel_size} x {context_parallel_size}")
    data_parallel = world // model_parallel
    if (data_parallel * context_parallel_size) % expert_parallel_size:
        raise ValueError(f"expert-parallel size {expert_parallel_size} does not divide the data-parallel (x CP) size "
                         f"{data_parallel * context_parallel_size} of world size {world} at TP x PP = "
                         f"{tensor_parallel_size} x {pipeline_parallel_size}: choose parallel.expert among its "
                         "divisors")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             pipeline_model_parallel_size=pipeline_parallel_size,
                                             context_parallel_size=context_parallel_size,
                                             expert_model_parallel_size=expert_parallel_size,
                                             distributed_timeout_minutes=timeout_minutes)
    set_seed(seed)


def table_row_group():
    """The group a row-sharded table's rows are sharded over: every data-parallel rank (times the
    context-parallel ones) of this tensor- and pipeline-parallel position.  It is the tables' own,
    independent of an MoE backbone's expert parallelism: Megatron's data-parallel group with context
    parallelism, which holds exactly those ranks."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def set_seed(seed: int) -> None:
    """Megatron's convention: the default streams differ per pipeline stage, TP ranks share them,
    and the tensor-parallel tracker has a distinct stream per TP rank."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def shutdown(process_groups: bool = True) -> None:
    """Megatron's model-parallel state, then the process groups, joined before Python exits
    (`destroy_process_groups`; ``process_groups=False`` keeps them, for a caller that started them), then
    the world's patches (`world_patches`), also when the rest fails."""
    try:
        parallel_state.destroy_model_parallel()
        if process_groups:
            destroy_process_groups()
    finally:
        close_world_patches()
