"""Saving and finding checkpoints, the same way for every engine.

A save goes through three steps (`fe_megatron.checkpoint.files` describes the layout):

1. `start_save`: rank 0 makes a fresh ``iter_NNNNNNN.tmp`` folder; the engine's ranks then write
   their files into it;
2. `agree_on_failure`: every rank reports whether its writes succeeded; if any failed the
   ``.tmp`` folder is removed and every rank raises, so the tracker still names the previous
   checkpoint;
3. `commit`: all ranks hash the files in shares, rank 0 writes the manifest, renames the folder
   into place (and syncs the run directory, so the rename survives a power loss), replaces the
   tracker atomically and prunes beyond ``keep``.

`find_checkpoint` is the other side: the tracker's checkpoint, verified against its manifest by
all ranks together (or, with ``on_corrupt="previous"``, the newest intact one before it).
"""

from __future__ import annotations

import os
import shutil
import signal

import torch
import torch.distributed as dist

from fe_megatron.checkpoint.files import (MANIFEST, TRACKER, CheckpointError, checkpoint_files, checkpoint_problems, complete_iterations,
                                          file_digest, iteration_dir, prune, read_tracker, sync_directory,
                                          write_manifest, write_run_info, write_tracker)
from fe_megatron.training import faults
from fe_megatron.training.distributed import current_device


def start_save(directory: str, iteration: int) -> str:
    """A fresh, empty ``iter_NNNNNNN.tmp`` folder for ``iteration`` in ``directory`` (made by rank 0;
    every rank returns once it exists)."""
    tmp = iteration_dir(directory, iteration) + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    return tmp


def agree_on_failure(error, tmp: str, iteration: int) -> None:
    """Every rank reports ``error`` (None: its writes succeeded); when any rank failed, rank 0
    removes ``tmp`` and every rank raises a `CheckpointError`: the tracker is not moved."""
    faults.hang_if_due("hang_during_save", iteration, dist.get_rank())
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=current_device())  # NCCL: on GPU
    dist.all_reduce(failed)
    if int(failed):
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving iteration {iteration} failed on {int(failed)} rank(s)"
                              f"{f' (here: {error})' if error is not None else ''}; the tracker still names "
                              "the previous checkpoint") from error


def commit(tmp: str, directory: str, iteration: int, keep: int = 0, before_tracker=None) -> str:
    """Hash ``tmp``'s files (all ranks, in shares), write the manifest, rename ``tmp`` to the
    iteration's folder, make the tracker name it, and delete all but the newest ``keep``
    checkpoints (``keep`` 0: none).  ``before_tracker(final)`` runs on rank 0 between the rename
    and the tracker (an engine's own pointer, e.g. DeepSpeed's ``latest``).  Returns the final
    folder."""
    final = iteration_dir(directory, iteration)
    rank = dist.get_rank()
    digests = _digests_in_shares(tmp)
    if faults.at("kill_during_save", iteration, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        write_manifest(tmp, digests, iteration)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        sync_directory(directory)  # the rename itself is durable before the tracker names it
        if before_tracker is not None:
            before_tracker(final)
        write_tracker(directory, iteration)
        prune(directory, keep, protect=iteration)
    dist.barrier()
    return final


def seal(folder: str, iteration: int, info: dict) -> None:
    """Record run info in a checkpoint ``folder`` that another program wrote and committed (Megatron-LM's
    trainer), then hash its files (all ranks, in shares) into a manifest, so that it reads and verifies as
    one of fe-pretrain's."""
    rank = dist.get_rank()
    if rank == 0:
        write_run_info(folder, info)
    dist.barrier()
    digests = _digests_in_shares(folder)
    if rank == 0:
        write_manifest(folder, digests, iteration)
    dist.barrier()


def _digests_in_shares(folder: str) -> dict:
    """``{file: digest}`` of ``folder``'s files (`checkpoint_files`), each rank hashing its share; known on
    every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [checkpoint_files(folder) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    mine = {name: file_digest(os.path.join(folder, name)) for i, name in enumerate(names[0]) if i % world == rank}
    digests = [None] * world
    dist.all_gather_object(digests, mine)
    return {name: digest for part in digests for name, digest in part.items()}


def _uncommitted_newest(directory: str):
    """The newest iteration whose folder was renamed into place with its manifest (a save is
    complete then) in a run directory without a tracker, or None."""
    for iteration in reversed(complete_iterations(directory)):
        if os.path.isfile(os.path.join(iteration_dir(directory, iteration), MANIFEST)):
            return iteration
    return None


def verify_checkpoint(folder: str) -> list:
    """Problems with ``folder``'s files against its manifest, one line per file (all ranks share
    the hashing); ``[]`` when it is intact.  A checkpoint written before manifests existed (no
    manifest and no run info) is not verified."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = [None] * world
    dist.all_gather_object(problems, checkpoint_problems(folder, rank, world))
    return [problem for part in problems for problem in part]


def find_checkpoint(directory: str, on_corrupt: str = "error", log=print):
    """The folder of the checkpoint to resume from, verified: the tracker's, or (with
    ``on_corrupt="previous"``) the newest intact one before a damaged one.  None when the run
    has no checkpoint yet."""
    latest = read_tracker(directory)
    if latest is None:
        latest = _uncommitted_newest(directory)
        if latest is None:
            return None
        log(f"{directory} has no {TRACKER} but holds {os.path.basename(iteration_dir(directory, latest))} with its "
            "manifest: the save before the last stop was renamed into place but not yet named by the tracker. "
            "Resuming from it once its checksums pass")
    for iteration in reversed([it for it in complete_iterations(directory) if it <= latest]):
        folder = iteration_dir(directory, iteration)
        problems = verify_checkpoint(folder)
        if not problems:
            return folder
        report = f"checkpoint {folder} is damaged:\n  " + "\n  ".join(problems)
        if on_corrupt != "previous":
            raise CheckpointError(f"{report}\nRefusing to load it. Set training.on_corrupt_checkpoint=previous to "
                                  "resume from the newest intact checkpoint before it, or restore the files.")
        log(f"{report}\ntrying the checkpoint before it (training.on_corrupt_checkpoint=previous)")
    raise CheckpointError(f"no intact checkpoint in {directory}: every one failed its checksums")
