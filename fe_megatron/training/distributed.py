"""The launcher's environment for ``torch.distributed``: torchrun, the deepspeed launcher, srun,
or none (a single process), a process group that survives torchrun's restarts, this rank's
device, and logging from rank 0.  Both engines start here."""

from __future__ import annotations

import os
import socket

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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group(backend: str, timeout_minutes: float = 10.0) -> None:
    """``init_process_group`` from the launcher's environment, in a key space of this attempt's own,
    with every collective of the group failing after ``timeout_minutes`` without its peers (a lost
    host stops the job then, not after torch's default of 30 minutes for gloo).  Logs which host
    each rank runs on.

    Under torchrun, workers connect to the store that torchrun's agent hosts, and torch adds no
    per-attempt prefix to its keys, assuming a new store for every restart.  torchrun reuses
    the store, so after ``--max-restarts`` restarts a group the restarted workers read the dead
    workers' addresses and fail in gloo's connectFullMesh ("Connection refused").  Prefixing the
    keys with torchrun's restart count keeps every attempt apart on one node.  Across nodes the
    counts can differ (an agent restarts its workers without counting when another node's
    failure changed the membership), so ``launch_scripts/torchrun.sh`` sets
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: every attempt then gets a fresh store from its rank 0.
    """
    from datetime import timedelta

    timeout = timedelta(minutes=timeout_minutes)
    refuse_loopback_across_hosts()  # under NCCL too: megatron-core also makes gloo groups
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
    else:
        if _spans_hosts() and os.environ.get("RANK") == "0":
            print("note: torchrun's agents share one store across restarts, and after a node's failure the "
                  "nodes' restart counts can differ, leaving the restarted workers waiting for each other; "
                  "launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (launch_scripts/torchrun.sh sets it)", flush=True)
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"/fe_megatron/attempt_{attempt}", store), rank=rank,
                                world_size=world, timeout=timeout)
    if dist.get_world_size() > 1:
        log(f"process group: {describe_hosts()}; collectives time out after {timeout_minutes:g} min "
            "(parallel.distributed_timeout_minutes)")


def _spans_hosts() -> bool:
    """Whether this job's ranks run on more than one host (torchrun's LOCAL_WORLD_SIZE, or SLURM's node count)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None:
        return int(local) < int(os.environ.get("WORLD_SIZE", local))
    return int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1"))) > 1


def _own_address() -> str:
    """The IPv4 address this host's name resolves to: what gloo advertises to its peers unless
    GLOO_SOCKET_IFNAME names an interface; "" when the name does not resolve."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


def refuse_loopback_across_hosts() -> None:
    """A clear error, before any connection, when ranks on other hosts would be told to reach this
    one on a loopback address: gloo advertises the address the host's name resolves to, and many
    distributions map the name to 127.0.1.1 in /etc/hosts.  Peers would then fail to connect
    (or hang until the timeout) with no hint why."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or not _spans_hosts():
        return
    address, name = _own_address(), socket.gethostname()
    fix = ("Set GLOO_SOCKET_IFNAME to the interface the hosts reach each other on (e.g. GLOO_SOCKET_IFNAME=eth0), "
           "or map the host name to that interface's address in /etc/hosts")
    if not address:
        raise RuntimeError(f"this job spans several hosts, but this host's name {name!r} does not resolve to an "
                           f"address: gloo could not tell its peers where to reach it. {fix}")
    if address.startswith("127."):
        raise RuntimeError(f"this job spans several hosts, but this host's name {name!r} resolves to {address}: "
                           f"gloo would give its peers a loopback address. {fix}")


def describe_hosts() -> str:
    """Which ranks run on which host, and the address each host's gloo groups advertise (NCCL
    picks its own interface, NCCL_SOCKET_IFNAME), gathered from every rank:
    "4 ranks on 2 hosts: node1 10.0.0.11 (ranks 0-1), node2 10.0.0.12 (ranks 2-3)"."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    mine = (socket.gethostname(), f"interface {interface}" if interface else _own_address() or "unresolved")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    hosts = {}
    for rank, host in enumerate(everyone):
        hosts.setdefault(host, []).append(rank)
    parts = []
    for (name, address), ranks in hosts.items():
        spans = f"ranks {ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1 \
            else f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"
        parts.append(f"{name} {address} ({spans})")
    return f"{len(everyone)} ranks on {len(hosts)} host{'s' if len(hosts) > 1 else ''}: {', '.join(parts)}"


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
