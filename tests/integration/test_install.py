"""setup.py's kernel build, each case a ``setup.py --version`` (which decides the extensions) in a process of
its own: setup.py builds the CUDA kernels only where they can be built, and says why not once; forcing the
build on where it cannot build fails loudly, naming the reason (FE_MEGATRON_CUDA, docs/compatibility.md)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import ROOT


def setup_py(cuda: str, **env):
    """``python setup.py --version`` (which decides the extensions) under ``FE_MEGATRON_CUDA=cuda``."""
    run_env = dict(os.environ, FE_MEGATRON_CUDA=cuda, PYTHONWARNINGS="ignore", **env)
    return subprocess.run([sys.executable, "setup.py", "--version"], capture_output=True, text=True, cwd=ROOT,
                          env=run_env, timeout=120)


def cuda_buildable() -> bool:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    return torch.version.cuda is not None and home is not None and \
        os.path.exists(os.path.join(home, "include", "cuda_runtime.h"))


def test_auto_skips_the_cuda_kernels_where_they_cannot_build_and_says_why_once():
    if cuda_buildable():
        pytest.skip("torch has CUDA and a complete toolkit here: auto builds the kernels")
    proc = setup_py("auto")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("0.1.0"), proc.stderr[-2000:]
    assert proc.stderr.count("CUDA kernels not built (") == 1, proc.stderr[-2000:]
    assert "FE_MEGATRON_CUDA=1 forces the build" in proc.stderr


def test_forcing_the_cuda_build_where_it_cannot_build_fails_naming_the_reason():
    if cuda_buildable():
        pytest.skip("torch has CUDA and a complete toolkit here: the forced build would run")
    proc = setup_py("1")
    assert proc.returncode != 0
    assert "FE_MEGATRON_CUDA=1 asks for the CUDA kernels, but they cannot be built: " in proc.stderr


def test_a_toolkit_without_its_headers_is_named(tmp_path):
    """torch guesses CUDA_HOME from nvcc's folder; a wrapper script in /usr/local/bin points it at a folder
    without the toolkit's headers, where the build used to stop at cuda_runtime.h."""
    if torch.version.cuda is None:
        pytest.skip("torch is a CPU build here: the toolkit is never looked at")
    proc = setup_py("1", CUDA_HOME=str(tmp_path))
    assert proc.returncode != 0
    assert f"the CUDA toolkit at {tmp_path} is incomplete" in proc.stderr and "set CUDA_HOME" in proc.stderr


def test_never_and_a_bad_value():
    assert setup_py("0").returncode == 0
    proc = setup_py("sometimes")
    assert proc.returncode != 0 and "FE_MEGATRON_CUDA='sometimes': use 1" in proc.stderr
