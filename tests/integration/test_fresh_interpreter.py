"""What a new Python process sees: the training entry module imports nothing heavy, importing every module
of the package changes nothing global, the tests' start-up hook
is in place (megatron-core's jit_fuser plain), Triton on a CPU
without its interpreter says how to make it available, the spec module Megatron-LM's own scripts import
reads its memory from the environment, and destroying the process groups leaves other libraries' caches
alone. Each runs in an interpreter of its own, whose imports and environment the test process cannot
stand in for."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.kernels import CUDA
from tests.helpers.paths import ROOT


def test_the_training_entry_module_imports_nothing_heavy():
    """A process that multiprocessing's spawn starts imports the parent's main module again: under
    ``-m fe_megatron.train`` and ``fe-pretrain`` megatron-core's checkpoint writer starts its helper
    so at the first save, which cost the trainer 1 s while the helper imported torch."""
    script = ("import sys, fe_megatron.train; heavy = [m for m in ('torch', 'megatron', 'deepspeed', 'numpy') "
              "if m in sys.modules]; print(heavy)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


IMPORT_EVERY_MODULE = textwrap.dedent("""
    import importlib, os, sys, warnings
    warnings.filterwarnings("ignore")
    from tests.helpers.patched import changed, snapshot
    from tests.helpers.paths import PACKAGE

    before = snapshot()
    assert not [name for name in sys.modules if name.startswith("fe_megatron")], "imported before the snapshot"
    names = []
    for folder, _, files in os.walk(PACKAGE):
        for file in sorted(files):
            dotted = os.path.relpath(os.path.join(folder, file), os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
            if file.endswith(".py") and file != "__main__.py":
                names.append(dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted)
    missing = []
    for name in sorted(names):
        try:
            importlib.import_module(name)
        except ImportError as error:  # an optional stack this install lacks (vllm; megatron.training before 0.19)
            missing.append(f"{name}: {error}")
    print(f"imported {len(names) - len(missing)} of {len(names)} modules; without their stack: {missing}")
    print("changed:", changed(before, snapshot()))
""")


def test_importing_every_module_of_the_package_changes_nothing_global():
    """No monkeypatch and no registration at import: torch.Tensor's ``cuda`` and ``type``, the kernels'
    gradient sinks and every megatron attribute the adapter replaces (tests/helpers/patched.py) are what
    they were before; a run installs them (`fe_megatron.megatron.patches`)."""
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    assert done.stdout.strip().splitlines()[-1] == "changed: []", done.stdout


def test_the_processes_the_tests_start_find_megatron_core_s_jit_fuser_plain():
    """tests/helpers/startup/sitecustomize.py runs first in every process the tests start (tests/conftest.py
    puts its folder on PYTHONPATH): megatron-core's jit_fuser is then a plain decorator, which saves each
    process importing torch's compiler stack; FE_TESTS_KEEP_JIT_FUSER=1 keeps torch.compile."""
    code = ("import megatron.core.jit as jit, torch; "
            "print(jit.jit_fuser is jit.noop_decorator, jit.jit_fuser is torch.compile)")
    for keep, expected in (("0", "True False"), ("1", "False True")):
        env = dict(os.environ, FE_TESTS_KEEP_JIT_FUSER=keep, PYTHONWARNINGS="ignore")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0 and done.stdout.split("\n")[-2] == expected, (keep, done.stdout + done.stderr)


@pytest.mark.skipif(CUDA, reason="checks the message on a machine without a GPU")
def test_triton_on_cpu_says_how_to_make_it_available():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from fe_megatron import ops\nwith ops.use_backend('triton'):\n    pass"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    assert "kernel backend 'triton' is not available here: it needs the triton package and a GPU; on a CPU set " \
           "TRITON_INTERPRET=1 before fe_megatron.ops is imported" in proc.stderr


def test_megatron_lm_spec_module_reads_the_environment(tmp_path):
    code = ("import warnings; warnings.filterwarnings('ignore');"
            "from fe_megatron.megatron import megatron_lm_spec as m;"
            "print(m.factorengram_local_spec.module.__name__, m.memory_config.layers, m.memory_config.hidden_size)")
    env = dict(os.environ, FE_MEMORY_PRESET="factorengram-tiny")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "FactorEngramTransformerLayer" and "[1, 2] 128" in out
    cfg = tmp_path / "m.yaml"
    cfg.write_text("memory:\n  preset: factorengram-tiny\n  layers: [3]\n")
    env = dict(os.environ, FE_MEMORY_CONFIG=str(cfg))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "[3] 128" in out


SCRIPT = textwrap.dedent("""
    import functools, socket, threading
    import torch, torch.distributed as dist
    import torch._dynamo as dynamo  # before: it fills its registries when imported
    from fe_megatron.training.distributed import destroy_process_groups

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    def square(x):
        return x * x
    square.__module__ = "megatron.core.example"  # as Megatron's rotary embedding: a cache that keeps its arguments
    megatron_cache = functools.lru_cache(square)
    other_cache = functools.lru_cache(lambda x: x + 1)
    megatron_cache(torch.randn(3)), other_cache(2)

    class Holder:
        pass
    holder = Holder()
    holder.group = dist.new_group([0])
    holder.groups = [holder.group, 7]

    destroy_process_groups()

    assert megatron_cache.cache_info().currsize == 0, "Megatron's cache still keeps its arguments"
    assert other_cache.cache_info().currsize == 1, "a cache of another library was emptied"
    assert holder.group is None and holder.groups == [None, 7], (holder.group, holder.groups)
    left = [t.name for t in threading.enumerate() if t.name.startswith(("pt_gloo", "gloo_"))]
    assert not left, left

    # torch.compile keeps its table of polyfills (all(), any(), ...) in a functools.cache
    def all_positive(xs):
        return torch.tensor(1.0) if all(x > 0 for x in xs) else torch.tensor(0.0)
    explain = dynamo.explain(all_positive)([1, 2, 3])
    assert explain.graph_break_count == 0, explain.break_reasons
    print("ok")
""")


def test_destroying_the_groups_keeps_other_libraries_caches():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
