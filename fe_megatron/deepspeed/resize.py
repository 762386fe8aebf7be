"""Resuming a DeepSpeed checkpoint at another data-parallel size (a node lost, or added).

ZeRO stages 1-3 save each rank's partition of the flat fp32 weights and Adam moments, cut for
the data-parallel size that saved them, and DeepSpeed refuses to load them at another size.
DeepSpeed's own answer is its universal checkpoint: ``deepspeed.checkpoint.ds_to_universal``
rewrites the partitions as one file per parameter and moment, and an engine built with
``checkpoint.load_universal`` cuts them again for its own size.  `universal_copy` makes that copy
(rank 0 converts, the others wait) in a scratch folder of the save directory, which is deleted
once every rank has loaded; the checkpoint itself is only read.

The row-sharded tables (``parallel.table_sharding: rows``) are outside ZeRO and reshard on their
own (`fe_megatron.deepspeed.tables.RowShardedTables.load`).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import os
import shutil

import torch.distributed as dist

SCRATCH = ".fe_universal"  # under the save directory; not an iteration folder, so no reader mistakes it for one


def needs_universal_copy(folder: str, saved_data_parallel_size: int, data_parallel_size: int) -> bool:
    """Whether ``folder`` holds ZeRO partitions cut for another data-parallel size than this run's."""
    partitioned = glob.glob(os.path.join(folder, "*optim_states.pt"))
    return bool(partitioned) and saved_data_parallel_size != data_parallel_size


def universal_copy(folder: str, save_dir: str) -> str:
    """``folder`` as a DeepSpeed universal checkpoint, in ``SAVE/.fe_universal/<tag>``; returns
    that path (same on every rank).  Collective: every rank must call it."""
    out = os.path.join(save_dir, SCRATCH, os.path.basename(folder))
    error = None
    if dist.get_rank() == 0:
        try:
            shutil.rmtree(out, ignore_errors=True)  # a copy left by a run stopped mid-conversion
            write_universal(folder, out)
        except Exception as err:  # noqa: BLE001 - every rank must learn it, not wait forever
            error = f"{type(err).__name__}: {err}"
    errors = [error]
    dist.broadcast_object_list(errors, src=0)
    if errors[0] is not None:
        raise RuntimeError(f"could not rewrite {folder} for another data-parallel size (DeepSpeed's "
                           f"ds_to_universal): {errors[0]}; resume at the size that saved it")
    return out


def write_universal(folder: str, out: str) -> None:
    """DeepSpeed's ``ds_to_universal`` of checkpoint ``folder`` into ``out``: one folder per
    parameter (``out/zero/<name>/``) holding its fp32 weights and Adam moments.  Quiet (it prints a
    progress bar per parameter); one process."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=folder, output_folder=out, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)


def remove_universal_copy(save_dir: str) -> None:
    """Delete the copies once every rank has loaded.  Collective."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(save_dir, SCRATCH), ignore_errors=True)
