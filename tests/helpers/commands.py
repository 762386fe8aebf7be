"""The installed console scripts (fe-pretrain, fe-data, fe-plan, ...) run as a user runs them."""

import os
import subprocess
import sys

from tests.helpers.paths import ROOT

BIN = os.path.dirname(sys.executable)


def command(name: str) -> list:
    """An installed console script, as a user runs it."""
    path = os.path.join(BIN, name)
    assert os.path.isfile(path), f"{name} is not installed in {BIN}"
    return [path]


def run(cmd, **kwargs):
    """``cmd`` from the repository root without the launcher's variables, its output captured (one thread per
    process, as tests/conftest.py sets for every process the tests start)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, **kwargs)
