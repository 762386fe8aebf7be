"""Checkpoints written before the memory module was unified (release 0.1.0) still load and mean the same."""

import pytest

from tests.helpers.torchrun_util import every_check_passed, torchrun

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("name, nproc", [("factorengram_tp2", 2), ("factorengram_tp2", 1), ("engram_tp1", 1)],
                         ids=["factorengram-tp2-at-tp2", "factorengram-tp2-at-tp1", "engram-tp1-at-tp1"])
def test_release_0_1_0_checkpoint_loads_and_gives_its_recorded_loss(name, nproc):
    out = torchrun("check_checkpoint_compat.py", "--name", name, "--tp", str(nproc), nproc=nproc)
    every_check_passed(out)
