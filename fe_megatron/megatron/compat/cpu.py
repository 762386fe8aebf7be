"""What the CPU backend (`fe_megatron.megatron.cpu_backend`) replaces in megatron-core and megatron.training:
the module-level ``torch`` of the modules below, the device RNG state functions, the MoE dispatcher's
split sizes, Megatron-FSDP's device meshes and the RNG tracker's warning.  Each replacement lasts until
the `PatchScope` it is made in closes; the contract "CPU backend targets"
(`fe_megatron.megatron.compat.contracts`) checks that they are still there."""

from __future__ import annotations

import importlib
import logging
from typing import Callable

import torch

from fe_megatron.megatron.patches import PatchScope

# megatron-core modules whose module-level ``torch`` the CPU backend replaces (`cpu_backend`);
# a module a release lacks is skipped.
CPU_BACKEND_MODULES = (
    "megatron.core.utils", "megatron.core.parallel_state", "megatron.core.timers",
    "megatron.core.rerun_state_machine", "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data", "megatron.core.tensor_parallel.utils",
    "megatron.core.distributed.distributed_data_parallel", "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads", "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.utils", "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_layer", "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention", "megatron.core.transformer.mlp",
    "megatron.core.transformer.utils", "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.dist_checkpointing.exchange_utils", "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.dist_checkpointing.strategies.torch", "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.transformer.moe.moe_layer", "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",
)
# megatron.training's modules (Megatron-LM's trainer, megatron-core 0.19 on) that assume CUDA; the CPU
# backend patches them when `fe_megatron.megatron_lm` runs that trainer (`enable_cpu_backend(trainer=True)`)
CPU_TRAINER_MODULES = (
    "megatron.training.training", "megatron.training.initialize", "megatron.training.utils",
    "megatron.training.utils.utils", "megatron.training.utils.common_utils", "megatron.training.checkpointing",
    "megatron.training.arguments", "megatron.training.models.dist_utils", "megatron.training.dist_signal_handler",
    "megatron.training.config.training_config", "megatron.core.num_microbatches_calculator",
    # Megatron-FSDP (--use-megatron-fsdp): its adapter and the megatron_fsdp package it wraps
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.utils",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard",
)
# the modules above that every supported release has (the contract checks them)
CPU_BACKEND_REQUIRED = (
    "megatron.core.tensor_parallel.random", "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.clip_grads",
    "megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)


def optional_module(name: str):
    """The module ``name``, or None where this install lacks that optional part of megatron."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def replace_module_torch(scope: PatchScope, names: tuple, proxy) -> None:
    """``proxy`` as the module-level ``torch`` of each module of ``names`` that this install has and that
    sees torch itself (one a scope around ``scope`` gave a proxy keeps it)."""
    for name in names:
        module = optional_module(name)
        if module is not None and getattr(module, "torch", None) is torch:
            scope.replace(module, "torch", proxy)


def replace_device_rng_state_functions(scope: PatchScope, get_state: Callable, set_state: Callable) -> None:
    """``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``, which the RNG tracker
    and activation recompute call to save and restore the device generator, replaced."""
    from megatron.core.tensor_parallel import random as mcore_random

    scope.replace(mcore_random, "_get_cuda_rng_state", get_state)
    scope.replace(mcore_random, "_set_cuda_rng_state", set_state)


def quiet_rng_tracker_warnings(scope: PatchScope) -> None:
    """Only errors from ``tensor_parallel.random``'s logger: where the CPU generator stands in for the
    device's, megatron's check that the CPU RNG is untouched inside a tracker fork would warn on every fork."""
    from megatron.core.tensor_parallel import random as mcore_random

    logger = logging.getLogger(mcore_random.__name__)
    level = logger.level
    logger.setLevel(logging.ERROR)
    scope.call_on_exit(lambda: logger.setLevel(level))


def split_sizes_as_numpy_on_the_host(scope: PatchScope) -> None:
    """megatron-core's all-to-all token dispatcher (``--moe-token-dispatcher-type alltoall``) turns its
    split sizes into numpy arrays for ``all_to_all_single`` with ``moe_utils.maybe_move_tensor_to_cpu(...,
    as_numpy=True)``, which converts a CUDA tensor only: on the host the sizes stayed tensors, and
    ``all_to_all_single`` refused them ("incompatible function arguments"). The dispatcher's copy converts a
    host tensor as a device one is converted (a copy, as the device-to-host move makes one)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    move = moe_utils.maybe_move_tensor_to_cpu

    def move_or_convert(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy().copy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    scope.replace(token_dispatcher, "maybe_move_tensor_to_cpu", move_or_convert)


def build_fsdp_device_meshes_on(scope: PatchScope, wrap: Callable) -> None:
    """Megatron-FSDP's adapter builds its device meshes with ``wrap(DeviceMesh.from_group)`` (the CPU
    backend's host meshes); nothing where this megatron-core has no Megatron-FSDP."""
    try:
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    except ImportError:
        return
    mesh = getattr(mcore_fsdp_adapter, "DeviceMesh", None)
    if mesh is None:
        return

    class HostDeviceMesh(mesh):
        from_group = staticmethod(wrap(mesh.from_group))

    scope.replace(mcore_fsdp_adapter, "DeviceMesh", HostDeviceMesh)
