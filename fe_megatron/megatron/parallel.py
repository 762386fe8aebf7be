"""Process groups and seeding for megatron.core, from torchrun's or SLURM's environment."""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from fe_megatron.megatron.cpu_backend import enable_cpu_backend


def _env_from_slurm() -> None:
    """Let ``srun python -m ...`` work like torchrun: derive RANK/WORLD_SIZE/LOCAL_RANK from SLURM."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        os.environ.setdefault("MASTER_PORT", "29500")
        if "MASTER_ADDR" not in os.environ:
            nodelist = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
            os.environ["MASTER_ADDR"] = nodelist.split(",")[0].split("[")[0]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_process_group(backend: str) -> None:
    """``init_process_group`` from the launcher's environment, in a key space of this attempt's own.

    Under torchrun, workers connect to the store that torchrun's agent hosts, and torch adds no
    per-attempt prefix to its keys, assuming a new store for every restart.  torchrun reuses
    the store, so after ``--max-restarts`` restarts a group the restarted workers read the dead
    workers' addresses and fail in gloo's connectFullMesh ("Connection refused").  Prefixing the
    keys with torchrun's restart count keeps every attempt apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    from torch.distributed.constants import default_pg_timeout

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=default_pg_timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"/fe_megatron/attempt_{attempt}", store), rank=rank,
                            world_size=world)


def initialize(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, seed: int = 1234,
               context_parallel_size: int = 1, table_sharding: str = "replicated") -> None:
    """Start torch.distributed (nccl on GPU, gloo on CPU), megatron's groups and its RNG streams.

    ``table_sharding="rows"`` makes Megatron's expert-parallel group the data-parallel group (times
    the context-parallel one): the memory-parallel group the tables' rows are sharded over
    (`fe_megatron.megatron.memory_layer`).  Runs single-process when no launcher variables are set.
    """
    _env_from_slurm()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # no launcher: a single process on a free local port
        os.environ["MASTER_PORT"] = str(_free_port())
    on_gpu = not enable_cpu_backend()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        _init_process_group("nccl" if on_gpu else "gloo")
    world = dist.get_world_size()
    model_parallel = tensor_parallel_size * pipeline_parallel_size * context_parallel_size
    if world % model_parallel:
        raise ValueError(f"world size {world} is not divisible by TP x PP x CP = {tensor_parallel_size} x "
                         f"{pipeline_parallel_size} x {context_parallel_size}")
    memory_parallel = world // (tensor_parallel_size * pipeline_parallel_size) if table_sharding == "rows" else 1
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel_size,
                                             pipeline_model_parallel_size=pipeline_parallel_size,
                                             context_parallel_size=context_parallel_size,
                                             expert_model_parallel_size=memory_parallel)
    set_seed(seed)


def set_seed(seed: int) -> None:
    """Megatron's convention: the default streams differ per pipeline stage, TP ranks share them,
    and the tensor-parallel tracker has a distinct stream per TP rank."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def shutdown() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
