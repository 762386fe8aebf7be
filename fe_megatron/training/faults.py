"""Faults injected on purpose, for the tests of what happens when things go wrong.

``FE_MEGATRON_FAULTS`` holds comma-separated ``NAME@STEP`` (optionally ``NAME@STEP:RANK``)
entries; the trainer asks `at` whether one is due.  Known faults:

* ``nan_loss@S``: the first microbatch of step S on rank 0 gets a NaN loss mask (the loss and
  every gradient become NaN).
* ``kill_during_save@S[:R]``: rank R (default 0) kills itself with SIGKILL once every rank has
  written its part of checkpoint S and hashed it, before the commit.  Rank 0 commits, so killing
  it leaves S incomplete (``iter_S.tmp``); another rank's death leaves rank 0 to commit S whole.
* ``fail_after_save@S[:R]``: rank R raises after writing its part of checkpoint S.
* ``hang_during_save@S[:R]``: rank R stops answering after writing its part of checkpoint S, as
  a host that hangs or drops off the network mid-save would: it prints one line and sleeps
  until it is killed.  Its peers wait in their next collective until the process group's timeout
  (``parallel.distributed_timeout_minutes``).

Faults fire in a job's first attempt only: a job that SLURM requeued (``SLURM_RESTART_COUNT``)
or a worker group that torchrun restarted (``TORCHELASTIC_RESTART_COUNT``) inherits the
variable but runs as the recovery it tests would.  Nothing happens when the variable is unset.
"""

import os
import time

ENV = "FE_MEGATRON_FAULTS"


def at(name: str, step: int, rank: int) -> bool:
    """Whether fault ``name`` is due at ``step`` on global rank ``rank`` (in a first attempt)."""
    if any(int(os.environ.get(count) or 0) for count in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")):
        return False
    for entry in filter(None, (item.strip() for item in os.environ.get(ENV, "").split(","))):
        fault, _, when = entry.partition("@")
        due_step, _, due_rank = when.partition(":")
        if fault == name and int(due_step) == step and int(due_rank or 0) == rank:
            return True
    return False


def hang_if_due(name: str, step: int, rank: int) -> None:
    """Never return when fault ``name`` is due (`at`): the hung host of ``hang_during_save``."""
    if at(name, step, rank):
        print(f"injected fault: {name}@{step}:{rank}: rank {rank} stops answering", flush=True)
        while True:
            time.sleep(3600)
