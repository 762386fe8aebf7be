"""Everything fe_megatron may replace in another library's globals, read as it is now: a run installs these
into its `fe_megatron.megatron.patches.PatchScope` and undoes them when it ends, and importing the package
touches none of them (tests/integration/test_fresh_interpreter.py, tests/unit/test_train.py,
tests/unit/megatron_lm/test_trainer_patches.py).

Reading them imports no module of fe_megatron (the CPU backend's module lists are read from the source of
`fe_megatron.megatron.compat.cpu`), so that a fresh interpreter can read them before it imports the package."""

import ast
import importlib
import logging
import os
import sys

import torch

from tests.helpers.paths import PACKAGE

_ABSENT = object()
CPU_TARGETS = os.path.join(PACKAGE, "megatron", "compat", "cpu.py")

# (module, attribute) that the adapter replaces besides every module's ``torch`` (`compat.cpu`,
# `compat.checkpoints`, `compat.layers`, `compat.trainer`); a module this install lacks is skipped
REPLACED = (
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"),
    ("megatron.core.transformer.moe.moe_utils", "te_general_gemm"),
    ("megatron.core.distributed.fsdp.mcore_fsdp_adapter", "DeviceMesh"),
    ("megatron.core.dist_checkpointing.gpt_checkpoint_interop", "retarget_sharded_state_dict_to_gpt_checkpoint"),
    ("megatron.core.datasets.utils", "compile_helpers"),
    ("megatron.training.training", "get_megatron_optimizer_config"),
    ("megatron.training.training", "get_megatron_optimizer"),
    ("megatron.training.training", "training_log"),
    ("megatron.training.training", "save_checkpoint"),
    ("megatron.training.training", "load_checkpoint"),
    ("megatron.training.training", "initialize_megatron"),
    ("megatron.training.training", "build_pretraining_data_loader"),
    ("megatron.training.initialize", "_warmup_jit_function"),
    ("megatron.training.datasets.data_samplers", "build_pretraining_data_loader"),
    ("megatron.training.checkpointing", "handle_swiglu_in_state_dict"),
    ("megatron.training.arguments", "_print_args"),
    ("megatron.training.models.gpt", "GPTModel"),
    ("megatron.training.models.hybrid", "HybridModel"),
)


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def cpu_backend_modules() -> tuple:
    """`compat.CPU_BACKEND_MODULES` + `compat.CPU_TRAINER_MODULES`, read from their source."""
    tree = ast.parse(open(CPU_TARGETS).read(), CPU_TARGETS)
    values = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
              if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id in ("CPU_BACKEND_MODULES", "CPU_TRAINER_MODULES")}
    return values["CPU_BACKEND_MODULES"] + values["CPU_TRAINER_MODULES"]


def snapshot() -> dict:
    """``{what: the object there now}``: ``torch.Tensor.cuda`` and ``.type``, the kernels' gradient sinks (none
    before `fe_megatron.ops` is imported), the open patch scopes, the RNG tracker's log level, every megatron
    module's ``torch`` the CPU backend replaces, and `REPLACED`."""
    ops, patches = sys.modules.get("fe_megatron.ops"), sys.modules.get("fe_megatron.megatron.patches")
    found = {"torch.Tensor.cuda": torch.Tensor.cuda, "torch.Tensor.type": torch.Tensor.type,
             "ops.weight_gradient_sinks()": ops.weight_gradient_sinks() if ops else (),
             "open patch scopes": tuple(scope.name for scope in patches.open_scopes()) if patches else (),
             "tensor_parallel.random's log level": logging.getLogger("megatron.core.tensor_parallel.random").level}
    for name in cpu_backend_modules():
        module = _module(name)
        if module is not None:
            found[f"{name}.torch"] = getattr(module, "torch", _ABSENT)
    for name, attribute in REPLACED:
        module = _module(name)
        if module is not None:
            found[f"{name}.{attribute}"] = getattr(module, attribute, _ABSENT)
    return found


def changed(before: dict, after: dict) -> list:
    """What differs between two snapshots (by identity; the sinks and scopes by value), each as one line."""
    differ = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key, _ABSENT), after.get(key, _ABSENT)
        same = old == new if isinstance(old, (tuple, int)) else old is new
        if not same:
            differ.append(f"{key}: {old!r} -> {new!r}")
    return differ
