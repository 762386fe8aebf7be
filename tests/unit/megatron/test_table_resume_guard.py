"""The Megatron engine's table resume guard (`refuse_table_optimizer_change`): with the distributed optimizer,
a checkpoint resumes only with its tables trained the way that wrote it.  The saved side is read through
`TablePlan.saved_mode`; this run's side is its plan's mode as the run info records it (the Megatron-LM
trainer hands only that and the distributed optimizer, before its process group is up)."""

import pytest

from fe_megatron.checkpoint.files import CheckpointError
from fe_megatron.megatron.table_optimizer import refuse_table_optimizer_change


def saved(tables=None, distributed=True, memory=True):
    info = {"config": {"memory": {"layers": [1]} if memory else None,
                       "parallel": {"distributed_optimizer": distributed}}}
    if tables is not None:
        info["tables"] = tables
    return info


def current(tables, distributed=True):
    return {"tables": tables, "config": {"parallel": {"distributed_optimizer": distributed}}}


def test_a_change_of_trainer_is_refused_under_the_distributed_optimizer():
    with pytest.raises(CheckpointError, match=r"ckpt trained its tables as Megatron's parameters .* and this run "
                                              r"trains them in table stores"):
        refuse_table_optimizer_change("ckpt", saved(), current("stores"))  # before runs recorded it: parameters
    with pytest.raises(CheckpointError, match=r"ckpt trained its tables in table stores"):
        refuse_table_optimizer_change("ckpt", saved("stores", distributed=False), current("parameters"))


def test_the_same_trainer_or_no_distributed_optimizer_or_no_memory_resumes():
    refuse_table_optimizer_change("ckpt", saved("stores"), current("stores"))
    refuse_table_optimizer_change("ckpt", saved(), current("parameters"))
    refuse_table_optimizer_change("ckpt", saved("stores", distributed=False), current("parameters", False))
    refuse_table_optimizer_change("ckpt", saved(memory=False), current("stores"))
    refuse_table_optimizer_change("ckpt", saved("stores"), current(None))  # this run has no memory
