"""DeepSpeed's shared-memory all-reduce buffers on a CPU: removed when the run ends, and a dead run's at the start.

On a CPU, DeepSpeed's communication (``deepspeed.init_distributed``, its ``ShareMemComm`` op) gives each rank a
66 MB workspace in ``/dev/shm`` when every rank of the run is on one node, which its launcher says through
``LOCAL_SIZE`` (the ``deepspeed`` launcher sets it; torchrun does not, so its runs make none):
``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (``ops/csrc/cpu/comm/shm.cpp``).  DeepSpeed
never unlinks it, so every such run left one file per rank behind, and the node-shared tables, which need the
same tmpfs, then found it full.  So:

* `remove_own_buffer` (the engine's ``shut_down``): the file this rank made, once the run is over; the mapping
  DeepSpeed holds lives on until the process exits;
* `remove_dead_buffers` (the engine's start, before DeepSpeed makes its own): the files of runs that were killed
  before their end, by owner: this user's files that no process maps (``/proc/<pid>/maps``) and that are older
  than a starting run's creation window.  A live run maps every rank's file, so its files are never removed.
"""

from __future__ import annotations

import os
import time
from typing import Optional

FOLDER = "/dev/shm"
PREFIX = "deepspeed_allreduce_buffer_"
# a starting rank creates its file, fills it (66 MB) and then maps it: a younger unmapped file may be that
CREATION_WINDOW_S = 60.0


def own_buffer_name(environ=os.environ) -> Optional[str]:
    """The name of the workspace DeepSpeed makes for this rank, or None when it makes none (not every rank on
    this node: ``LOCAL_SIZE`` unset or not the world size)."""
    local, world, rank = environ.get("LOCAL_SIZE"), environ.get("WORLD_SIZE"), environ.get("RANK")
    if not local or local != world or rank is None:
        return None
    return f"{PREFIX}{os.getuid()}_{environ.get('MASTER_ADDR', '')}_{environ.get('MASTER_PORT', '')}_{rank}"


def remove_own_buffer(folder: str = FOLDER, environ=os.environ) -> bool:
    """Unlink this rank's workspace (`own_buffer_name`); True when there was one."""
    name = own_buffer_name(environ)
    if name is None:
        return False
    try:
        os.unlink(os.path.join(folder, name))
    except FileNotFoundError:
        return False
    return True


def mapped_files() -> set:
    """The paths of the files this user's processes map (``/proc/<pid>/maps``; another user's are unreadable)."""
    paths = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) == 6:
                        paths.add(fields[5].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:  # gone meanwhile, or not ours
            continue
    return paths


def remove_dead_buffers(folder: str = FOLDER, now: Optional[float] = None) -> list:
    """Remove this user's DeepSpeed workspaces in ``folder`` that no process maps and that are older than
    `CREATION_WINDOW_S`: runs that were killed.  Returns the names removed."""
    try:
        names = sorted(name for name in os.listdir(folder) if name.startswith(PREFIX))
    except OSError:
        return []
    if not names:
        return []
    now = time.time() if now is None else now
    mapped, removed = mapped_files(), []
    for name in names:
        path = os.path.join(folder, name)
        try:
            stat = os.stat(path)
        except OSError:
            continue
        if stat.st_uid != os.getuid() or now - stat.st_mtime < CREATION_WINDOW_S or path in mapped:
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return removed
