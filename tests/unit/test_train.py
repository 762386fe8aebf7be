"""fe-pretrain's entry (`fe_megatron.train`) without training: the arguments it asks for, overrides
between the options, --check, and the kernel backend it accepts for the tables' device."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.commands import command, run
from tests.helpers.paths import ROOT
from tests.helpers.training import CONFIG


def test_fe_pretrain_without_arguments_asks_for_the_config():
    proc = run(command("fe-pretrain"))
    assert proc.returncode == 2
    assert "the following arguments are required: --config" in proc.stderr and "memory" not in proc.stderr


def test_overrides_may_sit_between_the_options_and_check_exits_before_training(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fe_megatron.train", "--config", CONFIG, "training.train_steps=50",
                           "--save", str(tmp_path / "run"), "training.log_interval=1", "--check"],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    resolved = json.loads(proc.stdout)
    assert resolved["training"]["train_steps"] == 50 and resolved["training"]["log_interval"] == 1
    assert resolved["save"] == str(tmp_path / "run") and not os.path.exists(tmp_path / "run")


def test_forced_kernel_backend_must_take_the_tables_device():
    from fe_megatron.train import check_kernel_backend

    check_kernel_backend("cpp", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"kernel backend 'cpp' runs on cpu tensors, but this run's tables are on "
                                         r"cuda; use kernel_backend=auto or one of \['torch'"):
        check_kernel_backend("cpp", torch.device("cuda"))
