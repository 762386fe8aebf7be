"""Node-shared tables: one copy of the tables per node, in shared host memory
(``parallel.table_sharding: node``).

Row-sharded tables (`fe_megatron.tables.row_exchange`) split every table's rows over the row group, each
rank keeping its shard in its own memory, and every lookup crosses ranks, also between two ranks of one
node.  Node-shared tables keep that split and every row's owner, so the update rule, the gradients'
exchange and the checkpoint (by global row) are the row-sharded ones unchanged, and a run trains exactly
as a row-sharded one does.  What changes is where the shards live: the shards of one node's ranks are one
segment of the node's shared memory (a file in ``/dev/shm``, ``parallel.shared_table_folder``), each rank's
shard a slice of it, and every rank of the node maps the whole segment:

* **reading** (`NodeRows.read`): a rank reads the rows its node's ranks own straight from the segment;
  the row exchange moves rows only between nodes (`StageRowExchange` skips the node's owners);
* **writing**: a row is written by its owner only, by the update rule's step.  That happens after the
  step's last gradient exchange and before the next forward's first exchange, two collectives of the whole
  row group, so no rank reads a row while it is being written (`StageRowExchange` reads the node's rows
  after its first collective);
* **the update rule's state and the gradients** stay in each owner's own memory: once per node too.

Across nodes the rows are split: a node's segment holds its ranks' shards, ``rows / nodes`` of each table.

A segment's life (`share_node_rows`): the node's first rank of the row group checks the folder has room
(refusing the run with the bytes needed and free), creates the files, named
``fe_megatron-tables.<run id>.<creator's pid>.rank<creator's global rank>.table<t>``, and reserves their
pages; every rank of the node maps them (and the ranks check that they mapped the same files: a node name
shared by containers with folders of their own is refused); then the files are removed from the folder, and
each rank copies its shard in.  A failure on any rank at any point is raised on every rank, the files removed.  The memory stays mapped, and the kernel frees it when the last process mapping it ends, however
it ends (``kill -9`` included), so a run leaves nothing behind.  Only a crash during that start-up can leave
files; a later run's start removes the segment files whose creator process is gone, and never those of a
live one (`remove_dead_segments`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import secrets
import socket
from typing import Optional

import torch
import torch.distributed as dist

from fe_megatron.tables.store import RowsInFlight, TableStore

DEFAULT_FOLDER = "/dev/shm"
PREFIX = "fe_megatron-tables."


@dataclasses.dataclass
class NodeRows:
    """What a rank of a node-shared table knows of its node: the whole ``segment`` (a host `TableStore` over
    the node's rows, which every rank of the node maps), where each rank of the row group starts in it
    (``first_rows``, -1 for ranks of other nodes) and which ranks share it (``same_node``)."""

    segment: TableStore
    first_rows: torch.Tensor  # [group size] int64
    same_node: torch.Tensor  # [group size] bool

    def read(self, owners: torch.Tensor, local_rows: torch.Tensor, device) -> RowsInFlight:
        """The rows ``local_rows`` of owners ``owners`` (ranks of this node), read from the segment, on their
        way to ``device`` (through a pinned staging copy on a GPU)."""
        return self.segment.fetch(self.first_rows.to(owners.device)[owners] + local_rows, device)


def node_key() -> str:
    """What tells two nodes apart: the host's name and, under torchrun, the agent's node rank (two torchrun
    agents on one host, as in the multi-node tests' namespaces, keep separate segments)."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '')}"


def folder_free_bytes(folder: str) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_dead_segments(folder: str) -> list:
    """Remove the segment files in ``folder`` left by runs that crashed during start-up (their creator's
    process is gone); a live run's are kept.  Returns the names removed."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        parts = name[len(PREFIX):].split(".")
        if len(parts) < 2 or not parts[1].isdigit() or _process_alive(int(parts[1])):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            removed.append(name)
        except OSError:  # gone meanwhile, or another user's: left alone
            pass
    return removed


def _gather(value, group) -> list:
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _gib(size: int) -> str:
    return f"{size:,} bytes ({size / 2 ** 30:.2f} GiB)"


@dataclasses.dataclass(frozen=True)
class _NodeRanks:
    """This rank's place in the row group, and which of the group's ranks share its node."""

    group: Optional[dist.ProcessGroup]
    size: int  # ranks in the row group
    rank: int  # this rank's, in the row group
    name: str  # the node's key (`node_key`)
    members: list  # the row group's ranks on this node, in rank order: the first creates the segments

    @property
    def creates(self) -> bool:
        return self.rank == self.members[0]

    def gather(self, value) -> list:
        """``value`` of every rank of the row group (a collective when there are several)."""
        return _gather(value, self.group) if self.size > 1 else [value]


def share_node_rows(stores: list, partitions: list, group: Optional[dist.ProcessGroup], folder: str = DEFAULT_FOLDER,
                    key: Optional[str] = None) -> list:
    """Move every rank's shard of ``stores`` (host `TableStore`s, one per table, row-sharded over ``group`` by
    ``partitions``) into its node's segments (see the module docstring), and give each store its `NodeRows`
    (``store.node``).  Every rank of ``group`` calls it, with its tables in the same order.  Returns the
    segment files' names (removed already)."""
    for store in stores:
        if not store.on_host:
            raise ValueError("node-shared tables live in host memory: set memory.table_placement: host")
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    me = (key or node_key(), dist.get_rank() if dist.is_initialized() else 0, os.getpid(), secrets.token_hex(4))
    everyone = _gather(me, group) if size > 1 else [me]
    ranks = _NodeRanks(group, size, rank, me[0], [r for r, entry in enumerate(everyone) if entry[0] == me[0]])
    creator = everyone[ranks.members[0]]
    names = _segment_names(stores, creator)
    paths = [os.path.join(folder, name) for name in names]
    row_bytes = [store.weight.shape[1] * store.weight.element_size() for store in stores]
    node_rows = [sum(partition.local_rows(member) for member in ranks.members) for partition in partitions]
    _create_node_segments(folder, paths, [rows * width for rows, width in zip(node_rows, row_bytes)], ranks)
    segments = _map_node_segments(stores, paths, node_rows, folder, ranks)
    _copy_shards_in(stores, partitions, segments, ranks)
    if size > 1:
        dist.barrier(group=group)  # every shard is in place before any rank reads its node's rows
    return names


def _segment_names(stores: list, creator: tuple) -> list:
    """The segment files' names, one per table: the run id, the creator's pid and global rank, the table."""
    run_id, names = creator[3], []
    for number, store in enumerate(stores):
        table = store.layout.table if store.layout is not None else number
        names.append(f"{PREFIX}{run_id}.{creator[2]}.rank{creator[1]}.table{table}")
    return names


def _create_node_segments(folder: str, paths: list, sizes: list, ranks: _NodeRanks) -> None:
    """The node's first rank creates and reserves the segment files; a problem on any node's creator is raised on
    every rank alike (after one gather over the row group), the files removed."""
    problem = None
    if ranks.creates:
        try:
            problem = _create_segments(folder, paths, sizes, sum(sizes))
        except Exception as error:  # told to every rank below, never raised past their collective
            problem = f"node-shared tables: creating the segments in {folder} failed: {error!r}"
    problems = ranks.gather(problem)
    if any(problems):  # on every rank alike, whichever node's creator found it
        if ranks.creates:
            _unlink(paths)
        raise RuntimeError(problems[ranks.members[0]] or next(p for p in problems if p))


def _map_node_segments(stores: list, paths: list, node_rows: list, folder: str, ranks: _NodeRanks) -> list:
    """Every rank of the node maps the creator's files, ``[rows, width]`` each, and checks with one gather over
    the row group that they are the same files (a node name shared by hosts, or containers, that do not share the
    folder would otherwise map files of their own); then the creator removes them from the folder."""
    segments, files, problem = [], [], None
    try:
        for store, path, rows in zip(stores, paths, node_rows):
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} is not in this rank's {folder}")
            width = store.weight.shape[1]
            segment = torch.from_file(path, shared=True, size=rows * width, dtype=store.weight.dtype)
            status = os.stat(path)
            segments.append(segment.view(rows, width))
            files.append((status.st_dev, status.st_ino))
    except Exception as error:
        problem = f"node-shared tables: rank {ranks.rank} of the row group cannot map its node's segment: {error}"
    mapped = ranks.gather((problem, files))
    if ranks.creates:
        _unlink(paths)  # every rank of the node has mapped them, or failed to: remove them from the folder
    members = ranks.members
    problem = next((p for p, _ in mapped if p), None)
    strangers = [member for member in members if mapped[member][1] != mapped[members[0]][1]]
    if problem is None and strangers:
        problem = (f"node-shared tables: ranks {strangers} of the row group have the node name {ranks.name!r} of rank "
                   f"{members[0]} but do not see its files in {folder} (containers or hosts with one name and "
                   f"their own {folder}?): give each host its own name, or use parallel.table_sharding: rows")
    if problem is not None:
        raise RuntimeError(problem)
    return segments


def _copy_shards_in(stores: list, partitions: list, segments: list, ranks: _NodeRanks) -> None:
    """Each rank writes its shard into its slice of the node's segments, and gives each store its `NodeRows`."""
    size, rank = ranks.size, ranks.rank
    node_stores = []
    for store, partition, segment in zip(stores, partitions, segments):
        first, offset = [-1] * size, 0
        for member in ranks.members:
            first[member] = offset
            offset += partition.local_rows(member)
        store.share_rows(segment[first[rank]:first[rank] + partition.local_rows(rank)])
        node_stores.append((segment, first))
    same_node = torch.tensor([r in ranks.members for r in range(size)])
    for store, (segment, first) in zip(stores, node_stores):
        store.node = NodeRows(TableStore(segment, "host"), torch.tensor(first, dtype=torch.int64), same_node)


def _create_segments(folder: str, paths: list, sizes: list, needed: int) -> Optional[str]:
    """Create and reserve the node's segment files (the creator's part); the problem, or None."""
    if not os.path.isdir(folder):
        return (f"node-shared tables: the folder {folder!r} (parallel.shared_table_folder) does not exist; use "
                f"/dev/shm or another tmpfs mount")
    removed = remove_dead_segments(folder)
    if removed:
        print(f"node-shared tables: removed {len(removed)} segment file(s) of a run that ended during its start-up "
              f"from {folder}", flush=True)
    free = folder_free_bytes(folder)
    if free < needed:
        return (f"node-shared tables need {_gib(needed)} in {folder} on this node, and it has {_gib(free)} free: "
                f"enlarge it (docker run --shm-size, or mount -o remount,size=... {folder}), point "
                f"parallel.shared_table_folder at a larger tmpfs, or use more nodes (each holds rows / nodes)")
    for number, (path, size) in enumerate(zip(paths, sizes)):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            _unlink(paths[:number])
            return f"node-shared tables: cannot create {path}: {error}"
        try:
            os.posix_fallocate(fd, 0, max(size, 1))  # the pages now, not a SIGBUS on a full folder later
        except OSError as error:
            _unlink(paths[:number + 1])
            if error.errno in (errno.ENOSPC, errno.ENOMEM):
                return (f"node-shared tables need {_gib(needed)} in {folder} on this node; reserving {path} "
                        f"({_gib(size)}) failed: {error}. Free or enlarge {folder}")
            return f"node-shared tables: cannot reserve {path}: {error}"
        finally:
            os.close(fd)
    return None


def _unlink(paths: list) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
