"""The launcher's environment for ``torch.distributed``: torchrun, the deepspeed launcher, srun,
or none (a single process), a process group that survives torchrun's restarts, this rank's
device, and logging from rank 0.  Both engines start here."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def current_device() -> torch.device:
    """The device this rank computes on: its CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def log(message: str) -> None:
    """Print ``message`` once: on global rank 0, or in a process without a process group."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


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


def init_process_group(backend: str) -> None:
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


def launcher_environment() -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the launcher (torchrun and the
    deepspeed launcher set them; srun's are translated), or those of a single process on a free
    local port when no launcher set any."""
    _env_from_slurm()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # no launcher: a single process on a free local port
        os.environ["MASTER_PORT"] = str(_free_port())
