"""Faults injected on purpose, for the tests of what happens when things go wrong.

``FE_MEGATRON_FAULTS`` holds comma-separated ``NAME@STEP`` (optionally ``NAME@STEP:RANK``)
entries; the trainer asks `at` whether one is due.  Known faults:

* ``nan_loss@S``: the first microbatch of step S on rank 0 gets a NaN loss mask (the loss and
  every gradient become NaN).
* ``kill_during_save@S[:R]``: rank R (default 0) kills itself with SIGKILL after writing
  checkpoint S but before it is complete.
* ``fail_after_save@S[:R]``: rank R raises after writing its part of checkpoint S.

Nothing happens when the variable is unset.
"""

import os

ENV = "FE_MEGATRON_FAULTS"


def at(name: str, step: int, rank: int) -> bool:
    """Whether fault ``name`` is due at ``step`` on global rank ``rank``."""
    for entry in filter(None, (item.strip() for item in os.environ.get(ENV, "").split(","))):
        fault, _, when = entry.partition("@")
        due_step, _, due_rank = when.partition(":")
        if fault == name and int(due_step) == step and int(due_rank or 0) == rank:
            return True
    return False
