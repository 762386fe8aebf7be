"""Run at the start of every Python process the tests start (tests/conftest.py puts this folder on
PYTHONPATH): megatron-core's ``jit_fuser`` becomes a plain decorator.

megatron.core.jit makes ``jit_fuser = torch.compile``, and megatron-core decorates its fused GPU functions
(bias-GeLU, bias-SwiGLU, bias-dropout-add, MoE helpers) with it as its modules are imported. The decoration
imports torch's compiler stack (torch._dynamo, torch._inductor): about 2.8 s of CPU in every process that
imports megatron.core: a fifth of a test-size fe-pretrain run's CPU, and minutes of a test run.
The functions it decorates compute the same thing undecorated (torch.compile does not change results), and
the CPU configurations the tests run turn their fusions off. ``FE_TESTS_KEEP_JIT_FUSER=1`` keeps
megatron-core's decorator. `make gpu-check-dry` loads this file too; `make gpu-check`, on a GPU, does not.
"""

import importlib.abc
import importlib.machinery
import os
import sys


class _PlainJitFuser(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit as the normal path finder does, and runs ``disable_jit_fuser()`` after it."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core.jit":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            if hasattr(module, "disable_jit_fuser"):
                module.disable_jit_fuser()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("FE_TESTS_KEEP_JIT_FUSER") != "1" and not any(
        type(finder).__name__ == "_PlainJitFuser" for finder in sys.meta_path):
    sys.meta_path.insert(0, _PlainJitFuser())
