"""The files of a run directory: checkpoints, their checksums, the config that shaped them.

Layout of ``<run>/``::

    latest_checkpointed_iteration.txt    the tracker: the newest complete checkpoint
    iter_0000100/                        one checkpoint (the engine's files, e.g. a Megatron dist checkpoint)
        fe_run.json                      the resolved training config, the tokenizer's path and sha256,
                                         the parallel layout that wrote it
        fe_manifest.json                 sha256 and size of every other file, written last
        fe_tables/                       beside a DeepSpeed checkpoint (tables outside ZeRO) or a Megatron-FSDP
                                         one (fsdp_dtensor): the tables in stores and their optimizer state,
                                         a dist checkpoint (torch_dist) by global row, from the one table writer
    iter_0000200.tmp/                    a save in progress (or one that never finished: ignored)

A checkpoint is written under ``.tmp``, its files are hashed, the manifest is written, the
folder is renamed, and only then is the tracker replaced (atomically).  A save that fails or
is killed on any rank therefore never moves the tracker, and the previous checkpoint stays
loadable.  Loading verifies every file against the manifest and names the file that is
missing, truncated or changed.

Everything here is plain Python, shared by every engine and by fe-eval and fe-convert.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Optional

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "fe_manifest.json"
RUN_INFO = "fe_run.json"
# the tables' checkpoint beside an engine's own (fe_megatron.megatron.table_checkpoint, the one table writer:
# the DeepSpeed engine's tables outside ZeRO, and Megatron-FSDP's tables)
TABLES_BESIDE = "fe_tables"
_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, or does not fit the run that loads it."""


def has_tables_beside(folder: str) -> bool:
    """Whether checkpoint folder ``folder`` holds the tables' checkpoint in ``fe_tables/``."""
    return os.path.isfile(os.path.join(folder, TABLES_BESIDE, "metadata.json"))


def iteration_dir(run_dir: str, iteration: int) -> str:
    return os.path.join(run_dir, f"iter_{iteration:07d}")


def read_tracker(run_dir: str) -> Optional[int]:
    """The iteration the tracker names, or None when the run has no checkpoint yet."""
    path = os.path.join(run_dir, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        text = fh.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}")
    if not os.path.isdir(iteration_dir(run_dir, int(text))):
        raise CheckpointError(f"{path} names iteration {text} but {iteration_dir(run_dir, int(text))} is missing")
    return int(text)


def sync_directory(path: str) -> None:
    """fsync the directory ``path``: a rename or a new file inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(run_dir: str, iteration: int) -> None:
    tmp = os.path.join(run_dir, TRACKER + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(str(iteration))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(run_dir, TRACKER))
    sync_directory(run_dir)


def complete_iterations(run_dir: str) -> list:
    """Iterations with a complete (renamed) checkpoint folder, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = (_ITERATION_DIR.match(name) for name in os.listdir(run_dir))
    return sorted(int(match.group(1)) for match in found if match)


def prune(run_dir: str, keep: int, protect: int) -> list:
    """Delete all but the newest ``keep`` checkpoints (never ``protect``); returns the deleted ones."""
    if keep <= 0:
        return []
    others = [it for it in complete_iterations(run_dir) if it != protect]
    old = others[:max(len(others) + 1 - keep, 0)]  # ``protect`` is one of the ``keep``
    for iteration in old:
        shutil.rmtree(iteration_dir(run_dir, iteration), ignore_errors=True)
    return old


def file_digest(path: str) -> dict:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            sha.update(block)
    return {"bytes": os.path.getsize(path), "sha256": sha.hexdigest()}


def checkpoint_files(folder: str) -> list:
    """The files a manifest covers (relative paths, sorted): everything but the manifest itself."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != MANIFEST:
                out.append(relative)
    return sorted(out)


def write_manifest(folder: str, digests: dict, iteration: int) -> None:
    path = os.path.join(folder, MANIFEST)
    with open(path + ".tmp", "w") as fh:
        json.dump({"iteration": iteration, "files": dict(sorted(digests.items()))}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def read_manifest(folder: str) -> Optional[dict]:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: the checksum manifest is unreadable ({err})") from None


def check_files(folder: str, manifest: dict, names: list) -> list:
    """Problems with ``names`` (a share of the manifest's files), one line per damaged or missing file."""
    problems = []
    for name in names:
        expected = manifest["files"][name]
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{path}: missing")
            continue
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            problems.append(f"{path}: {size} bytes, the manifest says {expected['bytes']} (truncated or overwritten)")
        elif file_digest(path)["sha256"] != expected["sha256"]:
            problems.append(f"{path}: its sha256 differs from the manifest's (the file is damaged)")
    return problems


def checkpoint_problems(folder: str, rank: int = 0, world: int = 1) -> list:
    """Problems with checkpoint ``folder``'s files against its manifest, one line per file, for the
    share ``rank::world`` of the files; ``[]`` when intact.  A checkpoint written before manifests
    existed (no manifest and no run info) is not verified; one with run info but no manifest is."""
    try:
        manifest = read_manifest(folder)
    except CheckpointError as err:
        return [str(err)] if rank == 0 else []
    if manifest is None:
        written_with_manifests = os.path.isfile(os.path.join(folder, RUN_INFO))
        return [f"{os.path.join(folder, MANIFEST)}: missing"] if written_with_manifests and rank == 0 else []
    return check_files(folder, manifest, sorted(manifest["files"])[rank::world])


def write_run_info(folder: str, info: dict) -> None:
    with open(os.path.join(folder, RUN_INFO), "w") as fh:
        json.dump(info, fh, indent=1, sort_keys=True, default=str)


def read_run_info(folder: str) -> Optional[dict]:
    path = os.path.join(folder, RUN_INFO)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)
