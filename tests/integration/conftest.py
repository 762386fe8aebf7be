"""Fixtures of the integration tier: the reference runs that row-sharded tables and every table storage
are compared against."""

import pytest

from tests.helpers.torchrun_util import torchrun


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """tests/distributed/check_row_sharding.py at DP=1 with whole fp32 tables held as parameters (TP=1
    and TP=2): initial weights, per-step losses, final weights; what row-sharded tables and every
    table storage are compared against."""
    root = tmp_path_factory.mktemp("row_sharding")
    for tp, init in ((1, "--save-init"), (2, "--init")):  # both start from the same initial weights
        torchrun("check_row_sharding.py", "--tables", "replicated", "--tp", str(tp), init, str(root / "init"),
                 "--steps", "0:3", "--record", str(root / f"ref_tp{tp}.json"), "--save-final",
                 str(root / f"final_tp{tp}"), nproc=tp)
    return root
