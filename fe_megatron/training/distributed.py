"""The launcher's environment for ``torch.distributed``: torchrun, the deepspeed launcher, srun,
or none (a single process), a process group that survives torchrun's restarts, this rank's
device, and logging from rank 0.  Both engines start here."""

from __future__ import annotations

import functools
import gc
import os
import socket
import types

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

    # Imported after a group exists, torch._dynamo keeps the default group alive past
    # destroy_process_group (DeepSpeed imports it while it starts), and the group's threads then
    # end only during interpreter exit: see destroy_process_groups.
    import torch._dynamo  # noqa: F401

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


def destroy_process_groups() -> None:
    """Destroy every process group and drop every reference to one, so that the groups' native
    threads (gloo's work and transport loops) are joined now, while Python still runs.

    A group that outlives ``destroy_process_group`` is destroyed while the interpreter exits,
    where its threads can abort a finished run ("terminate called without an active exception",
    SIGABRT: a failure to the launcher). Groups outlive it wherever something still refers to them:
    library globals (Megatron's and DeepSpeed's registries of groups), modules and parameters
    (``cp_group``, ``ds_process_group``), ``lru_cache``s, which keep their arguments (Megatron's
    rotary embedding caches its module), and objects that the collector cannot free (a ZeRO-3
    engine's hooks on autograd's nodes, a cycle through C++). So: empty the caches, destroy the
    groups, and drop every reference to a group left in an object's or a module's attributes
    (directly, or in a list, tuple or dict there) or in a closure. The process ends after this.

    Only Megatron's, DeepSpeed's and fe_megatron's caches are emptied (`GROUP_CACHING_PACKAGES`):
    other libraries keep registries in ``functools.cache`` (torch.compile's table of polyfills is
    one), and emptying those breaks them for the rest of the process (a converter or a test calls
    this in-process).

    One pass over the collector's objects does all of it (about a million in a process that has
    imported torch and Megatron), with a type test per attribute before any call; then one
    collection frees the unreachable objects that hold a group some other way (a ``partial``'s
    arguments, a bound method, a suspended generator).  0.6 s at a rank's exit, where two passes
    and two collections took 1.1 s."""
    if dist.is_initialized():  # first: torch's own registry of the groups is attributes of an object too
        dist.destroy_process_group()
    group_types = _subclasses(dist.ProcessGroup)
    may_hold_groups = group_types | {list, tuple, dict}
    for holder in gc.get_objects():
        kind = type(holder)  # type(), not isinstance: some objects warn on __class__
        if kind is functools._lru_cache_wrapper and _defined_in(holder, GROUP_CACHING_PACKAGES):
            holder.cache_clear()
        if kind is types.CellType:  # a closure's variable
            if type(_cell_contents(holder)) in group_types:
                holder.cell_contents = None
        elif kind.__dictoffset__ != 0 and not issubclass(kind, type):
            attributes = _attributes(holder)
            candidates = [(name, value) for name, value in attributes.items() if type(value) in may_hold_groups]
            for name, value in candidates:
                kept = _without_groups(value, group_types)
                if kept is not value:
                    attributes[name] = kept
    gc.collect()


# The packages whose lru_caches can hold a process group or a module with one (Megatron's rotary
# embedding caches its forward, and so its module and its cp_group).
GROUP_CACHING_PACKAGES = ("megatron", "deepspeed", "fe_megatron")


def _subclasses(kind: type) -> set:
    """``kind`` and every subclass of it defined so far."""
    found, pending = {kind}, [kind]
    while pending:
        for sub in pending.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                pending.append(sub)
    return found


def _defined_in(function, packages: tuple) -> bool:
    module = getattr(function, "__module__", None) or ""
    return module.split(".")[0] in packages


def _attributes(holder) -> dict:
    """``holder.__dict__`` without its class's lookup hooks; empty where it has none (Python 3.12's
    ``typing.TypeVar`` says it has one and raises) or it is not a plain dict."""
    try:
        attributes = object.__getattribute__(holder, "__dict__")
    except AttributeError:
        return {}
    return attributes if type(attributes) is dict else {}


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _without_groups(value, group_types: set):
    """``value`` with its process groups (objects of ``group_types``) replaced by None: None for a
    group, a copy for a list, tuple or dict that holds one, ``value`` itself otherwise."""
    kind = type(value)
    if kind in group_types:
        return None
    if kind in (list, tuple) and not group_types.isdisjoint(map(type, value)):
        return kind(None if type(item) in group_types else item for item in value)
    if kind is dict and not group_types.isdisjoint(map(type, value.values())):
        return {key: None if type(item) in group_types else item for key, item in value.items()}
    return value


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
