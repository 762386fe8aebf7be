"""Every use of Megatron-Core's non-public API, in one place, for every supported release.

fe_megatron builds on megatron-core's public pieces (``ModuleSpec``, ``TransformerConfig``,
``GPTModel``, DDP, ``get_megatron_optimizer``, the schedules, ``dist_checkpointing``) and, where
no public hook exists, on a few internals: a ``TransformerLayer``'s private forward steps (the
memory branch sits between them), optimizer internals (a chain member of our own, one gradient
norm per step), the checkpoint writer's result queue, and the module-level ``torch`` and RNG
functions that the CPU backend answers.  Those internals move between releases; this module
is the only one that touches them, and `CONTRACTS` states what each use expects, so that an
upstream change fails one named check (``tests/unit/megatron/test_compat.py``) instead of a
training run.

Supported: megatron-core ``SUPPORTED_MEGATRON_CORE`` (docs/compatibility.md lists the releases
each end was tested with).  What changed inside that range and is answered here:

* 0.17: ``TransformerLayer._forward_mlp`` takes ``packed_seq_params``; layer-norm and MLP
  submodules may be builder callables instead of ``ModuleSpec``; ``megatron.training`` ships
  in the wheel;
* 0.19: DDP's gradient sync asks ``torch.cuda.current_stream()`` (the CPU backend answers it);
  ``megatron.training.pretrain`` takes a config container and builds models through a
  ``GPTModelConfig``'s builder; `fe_megatron.megatron_lm` drives that trainer through the hooks in
  "Megatron-LM's trainer" below (the model class its builder constructs, the optimizer overrides,
  the optimizer chain it trains with, the log, the save, and what a host without CUDA needs);
* later (megatron-core's main branch): ``_forward_post_mlp`` is gone; `post_mlp` does its work
  (the MLP's bias-dropout-add) when the layer lacks it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from typing import Callable

import torch

SUPPORTED_MEGATRON_CORE = (">=0.16.1", "<0.20")
OLDEST_TESTED, NEWEST_TESTED = "0.16.1", "0.19.2"


class UpstreamMoved(RuntimeError):
    """A megatron-core internal that fe_megatron relies on is not where, or not what, it was."""


def megatron_core_version() -> str:
    """The installed release, as its package metadata names it (megatron-core's own ``package_info``
    appends the git commit of the working directory)."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:  # a source checkout on the path
        from megatron.core import package_info

        return package_info.__version__


def _version_tuple(version: str) -> tuple:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = re.match(r"\d*", piece).group()  # "1rc2" -> 1
        parts.append(int(digits or 0))
    return tuple(parts)


def is_supported_version(version: str) -> bool:
    low, high = (_version_tuple(bound.lstrip("<>=")) for bound in SUPPORTED_MEGATRON_CORE)
    return low <= _version_tuple(version) < high


def unsupported_version_message() -> str | None:
    """None where the installed megatron-core is in the supported range, else what to do."""
    version = megatron_core_version()
    if is_supported_version(version):
        return None
    problems = broken_contracts()
    moved = ("; the internals fe_megatron relies on are where it expects them" if not problems
             else ". Internals that moved: " + " | ".join(problems))
    return (f"megatron-core {version} is outside the range fe_megatron supports and was tested on "
            f"({', '.join(SUPPORTED_MEGATRON_CORE)}; {OLDEST_TESTED} to {NEWEST_TESTED}){moved}")


# --------------------------------------------------------------------------- TransformerLayer steps
def fused_softmax_available() -> bool:
    """Whether Megatron's fused masked-softmax kernels (``scaled_masked_softmax_cuda`` and its
    causal sibling, from Megatron-LM's fused_kernels or apex) are installed.  Megatron-Core asks
    for them in bf16 and fp16 when ``masked_softmax_fusion`` is set, and fails without them."""
    return all(importlib.util.find_spec(name) is not None
               for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))


def _accepted(function) -> tuple[set, bool]:
    parameters = inspect.signature(function).parameters.values()
    names = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names, any(p.kind is p.VAR_KEYWORD for p in parameters)


@functools.lru_cache(maxsize=None)
def _attention_keywords(layer_class) -> tuple[frozenset, bool]:
    names, open_ended = _accepted(layer_class._forward_attention)
    return frozenset(names), open_ended


def forward_attention(layer, hidden_states: torch.Tensor, args: tuple, kwargs: dict):
    """``TransformerLayer._forward_attention``: input norm, self-attention and its residual add.
    Keywords the block passes that this release's attention step does not take (for example
    ``dynamic_inference_decode_only``) are dropped.  Returns ``(hidden_states, context)``."""
    names, open_ended = _attention_keywords(type(layer))
    if not open_ended:
        kwargs = {key: value for key, value in kwargs.items() if key in names}
    return layer._forward_attention(hidden_states, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _mlp_takes_packed_seq_params(layer_class) -> bool:
    return "packed_seq_params" in inspect.signature(layer_class._forward_mlp).parameters


def forward_mlp(layer, hidden_states: torch.Tensor, kwargs: dict):
    """``TransformerLayer._forward_mlp``: pre-MLP norm, MLP and its residual add, with the
    arguments this release takes (``packed_seq_params`` from 0.17 on)."""
    extra = {"padding_mask": kwargs.get("padding_mask")}
    if _mlp_takes_packed_seq_params(type(layer)):
        extra["packed_seq_params"] = kwargs.get("packed_seq_params")
    return layer._forward_mlp(hidden_states, kwargs.get("inference_context"), **extra)


def pre_mlp_layernorm(layer, hidden_states: torch.Tensor) -> torch.Tensor:
    """``TransformerLayer._forward_pre_mlp_layernorm`` (the norm before the MLP, with its recompute)."""
    return layer._forward_pre_mlp_layernorm(hidden_states)


def post_mlp(layer, mlp_output_with_bias, residual: torch.Tensor) -> torch.Tensor:
    """``TransformerLayer._forward_post_mlp``: the MLP's bias-dropout-add onto the residual.  Where
    a release has no such step, the same bias-dropout-add, as its ``_forward_mlp`` does it (without
    0.19's pre-MLP-norm recompute and activation offloading, which fe_megatron does not turn on)."""
    if hasattr(layer, "_forward_post_mlp"):
        return layer._forward_post_mlp(mlp_output_with_bias, residual)
    from megatron.core.utils import make_viewless_tensor

    output = layer.mlp_bda(layer.training, layer.config.bias_dropout_fusion)(
        mlp_output_with_bias, residual, layer.hidden_dropout)
    return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)


# --------------------------------------------------------------------------- block building
def num_layers_to_build(config, vp_stage, pp_rank: int) -> int:
    """``transformer_block.get_num_layers_to_build``: this pipeline stage's layer count."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    return get_num_layers_to_build(config, vp_stage, pp_rank)


def default_block_norm():
    """``transformer_block.LayerNormImpl``: the final norm megatron-core picks (TE, Apex or torch)."""
    from megatron.core.transformer import transformer_block

    return transformer_block.LayerNormImpl


def ensure_metadata_dp_cp_group(metadata):
    """``transformer.utils.ensure_metadata_has_dp_cp_group``'s data-parallel (with context) group."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    return ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]


# --------------------------------------------------------------------------- optimizer internals
def chained_optimizer_class():
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    return ChainedOptimizer


def fp32_optimizer_class():
    from megatron.core.optimizer.optimizer import FP32Optimizer

    return FP32Optimizer


def param_group_identifier_keys() -> tuple:
    """The keys Megatron's checkpoint loader tells an optimizer's parameter groups apart by."""
    from megatron.core.optimizer import optimizer

    return tuple(optimizer.param_group_identifier_keys)


# The keys that tell an optimizer's parameter groups apart by what they hold (megatron-core 0.16's
# param_group_identifier_keys).  0.19 adds the schedule's per-group values (max_lr, min_lr, start_wd,
# end_wd, optimizer) to its identifiers, so a resume with another optimizer.lr finds no matching group.
STRUCTURAL_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
# A group's own schedule values, which a loaded group brings from the checkpoint in every release
SCHEDULE_GROUP_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")


def group_identifier(group: dict) -> tuple:
    """What tells parameter group ``group`` apart in every supported release (`STRUCTURAL_GROUP_KEYS`)."""
    return tuple(group.get(key) for key in STRUCTURAL_GROUP_KEYS)


def loader_group_identifier(group: dict) -> tuple:
    """What the installed release's checkpoint loader pairs parameter group ``group`` by
    (`param_group_identifier_keys`: from 0.19 also the group's schedule values)."""
    return tuple(group.get(key) for key in param_group_identifier_keys())


def adopt_checkpoint_group_values(optimizer, loaded_groups: list) -> list:
    """``loaded_groups``: the checkpoint's parameter groups of each member of ``optimizer``'s chain.
    Give every current parameter group the values the checkpoint's group with the same
    `STRUCTURAL_GROUP_KEYS` holds for the other identifier keys (from 0.19: the schedule's max_lr,
    min_lr, start_wd, end_wd), so that megatron-core pairs the groups whatever the schedule asked for
    now; the loaded groups then carry the checkpoint's values, as 0.16 loads them.  Returns each
    group's schedule values (`SCHEDULE_GROUP_KEYS`) from before, for `restore_group_values` (to follow
    this config's schedule instead of the checkpoint's)."""
    schedule_keys = [key for key in param_group_identifier_keys() if key not in STRUCTURAL_GROUP_KEYS]
    kept = sorted(set(schedule_keys) | set(SCHEDULE_GROUP_KEYS))
    before = []
    for member, member_groups in zip(optimizer_members(optimizer), loaded_groups):
        loaded = {group_identifier(group): group for group in member_groups}
        for group in member.optimizer.param_groups:
            before.append({key: group.get(key) for key in kept})
            match = loaded.get(group_identifier(group))
            if match is not None:
                for key in schedule_keys:
                    if key in match:
                        group[key] = match[key]
                    else:
                        group.pop(key, None)
    return before


def restore_group_values(optimizer, before: list) -> None:
    """Put back the values `adopt_checkpoint_group_values` returned into the loaded groups."""
    groups = [group for member in optimizer_members(optimizer) for group in member.optimizer.param_groups]
    for group, values in zip(groups, before):
        for key, value in values.items():
            if value is None:
                group.pop(key, None)
            else:
                group[key] = value


def optimizer_members(optimizer) -> list:
    """The members of a ``ChainedOptimizer``, or ``[optimizer]``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def step_with_grad_norm(optimizer, grad_norm: float) -> bool:
    """The rest of ``optimizer.step()`` once ``prepare_grads()`` and ``get_grad_norm()`` have run:
    clip every member by ``grad_norm`` (as ``ChainedOptimizer.step`` does) and apply the update.
    Megatron's own ``step()`` would prepare the gradients and compute the norm a second time: two
    passes over every gradient, the tables' included.  Returns whether the update was applied.
    Not applied here, as fe_megatron sets neither: 0.19's ``grad_norm_skip_threshold`` (a step
    skipped above a norm) and multi-token prediction's per-group clipping."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    takes_decoupled = "use_decoupled_grad" in inspect.signature(clip_grad_by_total_norm_fp32).parameters
    for member in optimizer_members(optimizer):
        if getattr(member, "is_stub_optimizer", False) or member.config.clip_grad <= 0.0:
            continue
        parameters = member.get_parameters()
        if not parameters:
            continue
        extra = {}
        if takes_decoupled:
            extra["use_decoupled_grad"] = bool(
                getattr(member.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                        getattr(member.config, "use_precision_aware_optimizer", False)))
        clip_grad_by_total_norm_fp32(parameters, max_norm=member.config.clip_grad, total_norm=grad_norm, **extra)
    return bool(optimizer.step_with_ready_grads())


def distributed_optimizer_class():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


def distributed_optimizer_runs_torch_adam() -> bool:
    """Whether the distributed optimizer runs torch's own Adam (no Apex or Transformer Engine fused
    Adam), which keeps its step count in every parameter's state instead of the groups."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def optimizer_state_sharding(state_dict: dict, model_sharded_state_dict: dict, parameters, exclude_keys: str):
    """``dist_checkpointing.optimizer``: replace ``state_dict``'s parameter ids by the model's
    ShardedTensors of ``parameters``, so the optimizer's states shard and reshard as the weights do."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)

    id_to_sharded_param_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, parameters)
    optim_state_to_sharding_state(state_dict, id_to_sharded_param_map, exclude_keys=exclude_keys)


def sharded_parameters(model_sharded_state_dict: dict, parameters) -> dict:
    """``{index: ShardedTensor or factory}``: the model's sharded object of each of ``parameters``."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    return get_param_id_to_sharded_param_map(model_sharded_state_dict, parameters)


# --------------------------------------------------------------------------- dist_checkpointing internals
def install_checkpoint_writer_queue(make_queue: Callable) -> None:
    """megatron-core's checkpoint writer collects results through a module-level queue
    (``filesystem_async._results_queue``), created on first use from a manager process of its own;
    give it ``make_queue()`` instead, unless one exists already."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = make_queue()


def reads_common_state_inside_torch_dist() -> bool:
    """Whether this release reads a checkpoint's common state from inside its torch_dist files, where
    newer releases write it, besides a ``common.pt`` of its own, where 0.16 writes it."""
    from megatron.core.dist_checkpointing import serialization

    return hasattr(serialization, "_legacy_common_state_exists")


def unreadable_checkpoint_problem(folder: str, written_by: str | None) -> str | None:
    """Why the installed megatron-core cannot read the dist checkpoint ``folder`` (None: it can).
    ``written_by`` names the megatron-core release that wrote it, where known."""
    import os

    if os.path.exists(os.path.join(folder, "common.pt")) or reads_common_state_inside_torch_dist():
        return None
    writer = f"megatron-core {written_by}" if written_by else "a newer megatron-core"
    return (f"{folder} was written by {writer}, which keeps a checkpoint's common state inside its torch_dist "
            f"files; megatron-core {megatron_core_version()}, installed here, reads it only from a common.pt "
            f"file and cannot load this checkpoint. Resume it with {writer} (docs/compatibility.md), or "
            "carry its weights over into a new run: fe-convert mcore-to-hf under the newer release, then fe-convert "
            "hf-to-mcore here, and --load the result")


# --------------------------------------------------------------------------- what the CPU backend patches
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
_CPU_BACKEND_REQUIRED = ("megatron.core.tensor_parallel.random", "megatron.core.distributed.param_and_grad_buffer",
                         "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.clip_grads",
                         "megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.p2p_communication",
                         "megatron.core.dist_checkpointing.strategies.filesystem_async")


def repair_moe_router_without_te() -> None:
    """megatron-core 0.16's MoE router reads ``moe_utils.te_general_gemm``, which that release binds
    only when Transformer Engine imports (later releases bind None otherwise): bind None, so that
    the router takes its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def replace_device_rng_state_functions(get_state: Callable, set_state: Callable) -> None:
    """``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``, which the RNG tracker
    and activation recompute call to save and restore the device generator, replaced."""
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = get_state
    mcore_random._set_cuda_rng_state = set_state


def split_sizes_as_numpy_on_the_host() -> None:
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

    token_dispatcher.maybe_move_tensor_to_cpu = move_or_convert


def _optional_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# --------------------------------------------------------------------------- Megatron-LM's trainer
# megatron.training (megatron-core 0.19 on) as `fe_megatron.megatron_lm` runs it.
TRAINER_MINIMUM = "0.19"


def has_megatron_lm_trainer() -> bool:
    """Whether the installed megatron-core ships the Megatron-LM trainer this project drives
    (megatron.training with the config-container ``pretrain`` of 0.19)."""
    from packaging.version import Version

    return Version(megatron_core_version()) >= Version(TRAINER_MINIMUM) and \
        importlib.util.find_spec("megatron.training") is not None


HYBRID_MINIMUM = "0.19"


def has_hybrid_model() -> bool:
    """Whether the installed megatron-core builds ``HybridModel`` (``megatron.core.models.hybrid``, 0.19 on;
    `fe_megatron.megatron.hybrid_specs` needs it)."""
    from packaging.version import Version

    return Version(megatron_core_version()) >= Version(HYBRID_MINIMUM) and \
        importlib.util.find_spec("megatron.core.models.hybrid") is not None


def building_gpt_model_as(model_class: Callable):
    """Inside the block, Megatron-LM's `GPTModelBuilder.build_model` constructs ``model_class``
    (called with GPTModel's keyword arguments) where it constructs ``GPTModel``."""
    from megatron.training.models import gpt

    return _replaced(gpt, "GPTModel", model_class)


def building_hybrid_model_as(model_class: Callable):
    """Inside the block, Megatron-LM's `HybridModelBuilder.build_model` constructs ``model_class``
    (called with HybridModel's keyword arguments) where it constructs ``HybridModel``."""
    from megatron.training.models import hybrid

    return _replaced(hybrid, "HybridModel", model_class)


@contextlib.contextmanager
def _replaced(module, name: str, value):
    """``module.name`` is ``value`` inside the block, and what it was after it."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def add_trainer_param_group_overrides(overrides: dict) -> None:
    """Megatron-LM's trainer builds its optimizer with ``overrides`` (``{ParamKey:
    ParamGroupOverride}``) added to the standard ones it derives from the arguments
    (``get_megatron_optimizer_config``: no weight decay on biases and norms, the decoupled LR)."""
    from megatron.training import training

    standard = training.get_megatron_optimizer_config

    def with_overrides(args):
        config, config_overrides = standard(args)
        return config, {**(config_overrides or {}), **overrides}

    training.get_megatron_optimizer_config = with_overrides


def extend_trainer_optimizer(extend: Callable) -> None:
    """Megatron-LM's trainer hands the optimizer it builds (``get_megatron_optimizer``'s chain) to
    ``extend`` and trains with what that returns (the chain with the tables' member added)."""
    from megatron.training import training

    standard = training.get_megatron_optimizer

    def extended(*args, **kwargs):
        return extend(standard(*args, **kwargs))

    training.get_megatron_optimizer = extended


def add_training_log_entries(entries: Callable[[dict, int], dict]) -> None:
    """Megatron-LM's trainer logs ``entries(loss_dict, iteration)`` (``{name: 1-element tensor}``;
    called on every rank after each step, where collectives are safe, with the step's reduced
    losses) beside ``lm loss``: averaged over the log interval, printed and written to TensorBoard
    the same way."""
    from megatron.training import training

    training_log = training.training_log

    def with_entries(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        return training_log({**loss_dict, **entries(loss_dict, iteration)}, total_loss_dict, learning_rate,
                            iteration, *args, **kwargs)

    training.training_log = with_entries


def after_each_save(hook: Callable[[int], None]) -> None:
    """``hook(iteration)`` on every rank after Megatron-LM's trainer has saved and committed a checkpoint."""
    from megatron.training import training

    save_checkpoint = training.save_checkpoint

    def save_then_hook(iteration, *args, **kwargs):
        result = save_checkpoint(iteration, *args, **kwargs)
        hook(iteration)
        return result

    training.save_checkpoint = save_then_hook


def around_trainer_loads(before: Callable, after: Callable) -> None:
    """Megatron-LM's trainer calls ``before(optimizer)`` right before it loads a checkpoint (``--load``)
    into the model and the optimizer it built and ``after(optimizer)`` right after, and loads it without
    autograd: in an fp32 run the distributed optimizer's main parameters are views of the model's, and
    its loader copies into them in place, which autograd refuses for views of parameters (fe-pretrain's
    loader does the same)."""
    from megatron.training import training

    load_checkpoint = training.load_checkpoint

    def load_between_hooks(ddp_model, optimizer, *args, **kwargs):
        if optimizer is not None:
            before(optimizer)
        with torch.no_grad():
            result = load_checkpoint(ddp_model, optimizer, *args, **kwargs)
        if optimizer is not None:
            after(optimizer)
        return result

    training.load_checkpoint = load_between_hooks


def wrap_trainer_checkpointing(save: Callable, load: Callable) -> None:
    """Megatron-LM's trainer saves with ``save(save_checkpoint)`` and loads with ``load(load_checkpoint)``:
    each receives the trainer's function and returns the one it calls instead, with the same parameters
    (``save_checkpoint(iteration, model, optimizer, ...)``, ``load_checkpoint(ddp_model, optimizer, ...)``)."""
    from megatron.training import training

    training.save_checkpoint = save(training.save_checkpoint)
    training.load_checkpoint = load(training.load_checkpoint)


class _LookupBelowWrappers:
    """A wrapped model (Megatron-FSDP's) whose ``get_parameter`` takes a name with any number of leading
    ``module.`` parts and looks it up in the innermost module; everything else is the model's."""

    def __init__(self, model):
        self._model = model

    def get_parameter(self, name: str):
        inner = self._model
        while isinstance(getattr(inner, "module", None), torch.nn.Module):
            inner = inner.module
        parts = name.split(".")
        while parts and parts[0] == "module":
            parts.pop(0)
        return inner.get_parameter(".".join(parts))

    def __getattr__(self, name):
        return getattr(self._model, name)


def repair_fsdp_dtensor_swiglu_lookup() -> None:
    """megatron-core 0.19's ``fsdp_dtensor`` save and load split SwiGLU's ``linear_fc1`` in two
    (``handle_swiglu_in_state_dict``), looking each weight up on the Megatron-FSDP module they are handed
    under ``module.`` plus a state-dict key that already starts with ``module.``: one wrapper too deep,
    which fails in every run without a Float16Module ("GPTModel has no attribute `module`", an fp32
    run). Hand it the model with a lookup below every wrapper (the same parameter objects)."""
    from megatron.training import checkpointing

    handle = getattr(checkpointing, "handle_swiglu_in_state_dict", None)
    if handle is None or getattr(handle, "looks_up_below_wrappers", False):
        return

    def handle_below_wrappers(model, *args, **kwargs):
        return handle(_LookupBelowWrappers(model), *args, **kwargs)

    handle_below_wrappers.looks_up_below_wrappers = True
    checkpointing.handle_swiglu_in_state_dict = handle_below_wrappers


def repair_gpt_to_hybrid_memory_load() -> None:
    """megatron-core 0.19 loads a GPT checkpoint into a HybridModel run by pointing the hybrid model's
    sharded state dict at the GPT checkpoint's keys (``gpt_checkpoint_interop``): ``decoder.layers.<i>.X``
    becomes ``decoder.layers.X`` with GPT layer ``g`` as a prepended axis, the format of a GPT model whose
    layers are all alike. A GPT model with memory has unlike layers (the memory is on some), so its
    checkpoints store every layer under its own index, ``decoder.layers.<g>.X``, and upstream's keys miss
    them all. For a hybrid model with memory the retargeting maps each layer to its GPT layer's own keys
    instead (`_retarget_to_gpt_layers`), the model and the optimizer state alike."""
    from megatron.core.dist_checkpointing import gpt_checkpoint_interop as interop

    if getattr(interop.retarget_sharded_state_dict_to_gpt_checkpoint, "per_layer", False):
        return
    _retarget_to_gpt_layers.per_layer = True
    interop.retarget_sharded_state_dict_to_gpt_checkpoint = _retarget_to_gpt_layers


def point_hybrid_state_at_gpt_checkpoint(sharded_state_dict, hybrid_layer_pattern: str) -> None:
    """``sharded_state_dict`` (a hybrid model's, or its optimizer's) pointed, in place, at the keys of a
    checkpoint the GPT model with memory wrote (fe-pretrain's loader; `repair_gpt_to_hybrid_memory_load` says
    why upstream's retargeting does not fit). The pattern must pair each attention layer with one MLP or MoE
    layer (megatron-core's ``gpt_compatible_layer_maps`` says what it refuses)."""
    from megatron.core.dist_checkpointing import gpt_checkpoint_interop as interop

    _retarget_to_gpt_layers(sharded_state_dict, interop.gpt_compatible_layer_maps(hybrid_layer_pattern))


def _retarget_to_gpt_layers(sharded_state_dict, layer_maps) -> None:
    """Each hybrid layer's entries at its GPT layer's own keys (``decoder.layers.<g>.``), ``decoder.final_norm``
    at ``decoder.final_layernorm``, and the local-only ``output_layer._extra_state`` kept local, as upstream's
    ``retarget_sharded_state_dict_to_gpt_checkpoint`` does them."""
    from megatron.core.dist_checkpointing import gpt_checkpoint_interop as interop

    def retarget(entry):
        if not isinstance(entry, interop.ShardedBase):
            return entry
        if entry.key.endswith(interop._GPT_OMITTED_LOCAL_KEYS):
            return interop.LocalNonpersistentObject(entry.data)
        match = interop._DECODER_LAYER_KEY_RE.search(entry.key)
        if match is not None:
            hybrid_layer = int(match.group(1))
            gpt_layer = layer_maps.attention_to_gpt.get(hybrid_layer, layer_maps.mlp_to_gpt.get(hybrid_layer))
            if gpt_layer is None:
                raise ValueError(f"{entry.key}: hybrid layer {hybrid_layer} has no GPT layer to load from (a GPT "
                                 "checkpoint with memory loads into '*' and '-' or 'E' layers only)")
            entry.key = f"{entry.key[:match.start()]}decoder.layers.{gpt_layer}.{entry.key[match.end():]}"
            return entry
        for hybrid_prefix, gpt_prefix in interop._GPT_FINAL_NORM_KEY_MAP.items():
            if hybrid_prefix in entry.key:
                entry.key = entry.key.replace(hybrid_prefix, gpt_prefix, 1)
        return entry

    interop.dict_list_map_inplace(retarget, sharded_state_dict)


@contextlib.contextmanager
def argument_dump_held(held: list):
    """Inside the block, megatron.training's argument validation appends its argument dump (about 850
    lines on rank 0) to ``held`` as ``(title, args)`` instead of printing it; print it with
    `print_argument_dump` once the run's own checks have passed, so that a refusal is not buried under it."""
    from megatron.training import arguments

    print_args = arguments._print_args
    arguments._print_args = lambda title, args: held.append((title, args))
    try:
        yield held
    finally:
        arguments._print_args = print_args


def print_argument_dump(held: list) -> None:
    from megatron.training import arguments

    for title, args in held:
        arguments._print_args(title, args)


def build_fsdp_device_meshes_on(wrap: Callable) -> None:
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

    mcore_fsdp_adapter.DeviceMesh = HostDeviceMesh


def run_trainer_on_host() -> None:
    """Megatron-LM's trainer on a machine without CUDA: ``pretrain`` initializes Megatron without its
    CUDA assertion (the CPU backend answers the rest, `cpu_backend.enable_cpu_backend(trainer=True)`), and
    what draws from the CPU generator outside the training steps (the JIT warm-up, the data loaders) leaves
    the generator that stands in for the device's alone, so that dropout resumes exactly."""
    from megatron.training import initialize, training

    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    # The JIT warm-up draws random tensors on the device; on the host they would come from the CPU
    # generator, which initializes the weights, and change them: keep that generator's state.
    warm_up = initialize._warmup_jit_function

    def warm_up_keeping_cpu_rng(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return warm_up(*args, **kwargs)

    initialize._warmup_jit_function = warm_up_keeping_cpu_rng
    # A data loader draws its workers' base seed from the CPU generator whenever an iterator is made: at the
    # start, at each epoch of a cyclic loader, and after a resume, at other points of the run. On the host
    # that generator is also the device's, which dropout draws from, so a resumed run's dropout followed
    # another stream. Each loader draws from a generator of its own (seeded by --seed), as on a GPU, where
    # dropout's generator is apart from the CPU one.
    from megatron.training import get_args
    from megatron.training.datasets import data_samplers

    build_loader = data_samplers.build_pretraining_data_loader

    def build_loader_with_own_generator(dataset, consumed_samples):
        loader = build_loader(dataset, consumed_samples)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(get_args().seed)
        return loader

    data_samplers.build_pretraining_data_loader = build_loader_with_own_generator
    training.build_pretraining_data_loader = build_loader_with_own_generator


def finish_fsdp_param_gathers(model_chunks: list) -> None:
    """Wait for the parameter all-gathers Megatron-FSDP started ahead of a next forward (nothing where a
    chunk is not under Megatron-FSDP). After the last step nothing else waits for them when no evaluation
    follows, and on gloo an unfinished gather kept its transport thread running past the groups' destruction,
    to Python's exit (`fe_megatron.training.distributed.destroy_process_groups`)."""
    for chunk in model_chunks:
        synchronize = getattr(chunk, "synchronize_param_gather", None)
        if callable(synchronize):
            synchronize()


def use_built_dataset_helpers() -> None:
    """The megatron-core wheel ships its dataset index helpers built (``helpers_cpp``) but not the
    Makefile that Megatron-LM's start-up runs to build them, which then fails: build them only where
    they are missing."""
    from megatron.core.datasets import utils

    compile_helpers = utils.compile_helpers

    def compile_if_missing():
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            compile_helpers()

    utils.compile_helpers = compile_if_missing


# --------------------------------------------------------------------------- contracts
@dataclass(frozen=True)
class Contract:
    """What one use above expects of megatron-core; ``check`` raises `UpstreamMoved` if it is not so."""

    name: str
    used_by: str
    check: Callable[[], None]


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise UpstreamMoved(f"megatron-core {megatron_core_version()}: {what}; fe_megatron/megatron/compat.py "
                            "must be adapted to this release")


def _has_parameters(function, names: tuple, where: str) -> None:
    present = set(inspect.signature(function).parameters)
    missing = [name for name in names if name not in present]
    _require(not missing, f"{where} no longer takes {missing} (it takes {sorted(present)})")


def _check_layer_steps():
    """The FFN placements (``before_ffn``, ``inside_ffn``) read the residual stream between the attention's
    residual add and the pre-MLP norm, and ``before_ffn`` adds the memory's output to that residual, outside
    the MLP's dropout. No public slot of megatron-core 0.16's ``TransformerLayer`` reaches it: a module in the
    MLP slot sees the normed stream and its output passes the hidden dropout, and only 0.19's pre-MLP norm may
    hand back a residual. So the layer runs ``_forward_attention``, then ``_forward_mlp`` (or the pre-MLP
    norm and ``_forward_post_mlp``) itself. ``before_attn``, the default, calls the public ``forward``."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for step in ("_forward_attention", "_forward_mlp", "_forward_pre_mlp_layernorm"):
        _require(callable(getattr(TransformerLayer, step, None)), f"TransformerLayer.{step} is gone")
    _has_parameters(TransformerLayer._forward_attention, ("hidden_states", "attention_mask", "context"),
                    "TransformerLayer._forward_attention")
    _has_parameters(TransformerLayer._forward_mlp, ("hidden_states", "inference_context"),
                    "TransformerLayer._forward_mlp")
    # _forward_post_mlp may be missing: post_mlp then does its bias-dropout-add itself


def _check_mlp_internals():
    """``inside_ffn`` adds the memory to SwiGLU's up branch inside megatron-core's ``MLP.forward``, which runs
    as it is: a forward hook on ``linear_fc1`` adds ``[0 | m]`` to its output, so the output's last axis must
    hold the gate columns, then the up columns (``torch.chunk(x, 2, dim=-1)``: gate, then up), added before
    the activation; and the layer recomputes the MLP where it does (``recompute_mlp``). No public MLP entry
    point takes an addend to the up branch."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    source = inspect.getsource(MLP.forward)
    _require("self.linear_fc1" in source and "self.linear_fc2" in source, "MLP.forward no longer runs linear_fc1 "
             "and linear_fc2")
    _require("x_glu, x_linear = torch.chunk(x, 2, dim=-1)" in source,
             "MLP.forward no longer splits linear_fc1's output into gate, then up halves (torch.chunk(x, 2, dim=-1))")
    _require("self.recompute_mlp" in inspect.getsource(TransformerLayer.__init__),
             "TransformerLayer no longer sets recompute_mlp")


def _check_layer_constructor():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    _has_parameters(TransformerLayer.__init__, ("config", "submodules", "layer_number", "hidden_dropout",
                                                "pg_collection", "vp_stage"), "TransformerLayer.__init__")


def _check_block():
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlock, get_num_layers_to_build

    _has_parameters(get_num_layers_to_build, ("config", "vp_stage", "pp_rank"), "get_num_layers_to_build")
    _has_parameters(TransformerBlock.forward, ("hidden_states", "attention_mask"), "TransformerBlock.forward")
    _has_parameters(GPTModel.forward, ("input_ids", "position_ids", "attention_mask", "extra_block_kwargs"),
                    "GPTModel.forward")
    _require(default_block_norm() is not None, "transformer_block.LayerNormImpl is gone")


def _check_sharded_state_dict_helpers():
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    _has_parameters(make_sharded_tensors_for_checkpoint, ("state_dict", "prefix", "tensor_parallel_layers_axis_map",
                                                          "sharded_offsets", "tp_group", "dp_cp_group"),
                    "make_sharded_tensors_for_checkpoint")
    _require(callable(ensure_metadata_has_dp_cp_group), "transformer.utils.ensure_metadata_has_dp_cp_group is gone")


def _check_optimizer_internals():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    chained, fp32 = chained_optimizer_class(), fp32_optimizer_class()
    for method in ("prepare_grads", "get_grad_norm", "step_with_ready_grads", "get_parameters",
                   "get_grad_stats_parallel_group"):
        _require(callable(getattr(chained, method, None)), f"ChainedOptimizer.{method} is gone")
        _require(callable(getattr(fp32, method, None)), f"FP32Optimizer.{method} is gone")
    # the tables' member reduces its norm over its own groups (get_grad_stats_parallel_group() is None),
    # which the chain then sums as the square root of the members' squares
    _require(callable(getattr(chained, "grads_states_parallel_group_is_shared", None)),
             "ChainedOptimizer.grads_states_parallel_group_is_shared is gone")
    _has_parameters(fp32.__init__, ("optimizer", "config", "init_state_fn"), "FP32Optimizer.__init__")
    _has_parameters(clip_grad_by_total_norm_fp32, ("parameters", "max_norm", "total_norm"),
                    "clip_grad_by_total_norm_fp32")
    keys = param_group_identifier_keys()
    _require(set(STRUCTURAL_GROUP_KEYS) <= set(keys),
             f"param_group_identifier_keys is {keys}; the tables' group and resuming with another schedule rely "
             f"on {STRUCTURAL_GROUP_KEYS} among them")
    from megatron.core.optimizer import distrib_optimizer

    _require(hasattr(distrib_optimizer, "HAVE_APEX_OR_TE"), "distrib_optimizer.HAVE_APEX_OR_TE is gone")
    from megatron.core.dist_checkpointing import optimizer as dist_optimizer

    for name in ("get_param_id_to_sharded_param_map", "optim_state_to_sharding_state"):
        _require(callable(getattr(dist_optimizer, name, None)), f"dist_checkpointing.optimizer.{name} is gone")


def _check_checkpoint_writer_queue():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _require(hasattr(filesystem_async, "_results_queue"),
             "dist_checkpointing.strategies.filesystem_async._results_queue is gone")


def _check_cpu_backend_targets():
    for name in _CPU_BACKEND_REQUIRED:
        module = _optional_module(name)
        _require(module is not None, f"module {name} is gone")
        _require(getattr(module, "torch", None) is not None, f"{name} no longer imports torch at module level")
    from megatron.core.tensor_parallel import random as mcore_random

    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state", "get_cuda_rng_tracker"):
        _require(callable(getattr(mcore_random, name, None)), f"tensor_parallel.random.{name} is gone")
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    _has_parameters(moe_utils.maybe_move_tensor_to_cpu, ("tensor", "as_numpy", "record_stream"),
                    "moe_utils.maybe_move_tensor_to_cpu")
    _require(getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None) is not None
             and "maybe_move_tensor_to_cpu(" in inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher),
             "the all-to-all token dispatcher no longer moves its split sizes with maybe_move_tensor_to_cpu")


def _check_trainer():
    if not has_megatron_lm_trainer():
        return  # fe_megatron.megatron_lm refuses to start and says which release it needs
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import initialize, training
    from megatron.training.models import gpt

    _require(inspect.getsource(gpt.GPTModelBuilder.build_model).count("GPTModel(") == 1,
             "megatron.training.models.gpt.GPTModelBuilder.build_model no longer constructs GPTModel by that name")
    if has_hybrid_model():
        from megatron.training.models import hybrid

        _require(inspect.getsource(hybrid.HybridModelBuilder.build_model).count("HybridModel(") == 1,
                 "megatron.training.models.hybrid.HybridModelBuilder.build_model no longer constructs HybridModel by "
                 "that name")
        from megatron.core.dist_checkpointing import gpt_checkpoint_interop as interop

        _has_parameters(interop.retarget_sharded_state_dict_to_gpt_checkpoint, ("sharded_state_dict", "layer_maps"),
                        "gpt_checkpoint_interop.retarget_sharded_state_dict_to_gpt_checkpoint")
        for name in ("_DECODER_LAYER_KEY_RE", "_GPT_FINAL_NORM_KEY_MAP", "_GPT_OMITTED_LOCAL_KEYS", "ShardedBase",
                     "LocalNonpersistentObject", "dict_list_map_inplace", "gpt_compatible_layer_maps"):
            _require(hasattr(interop, name), f"gpt_checkpoint_interop.{name} is gone")
        from megatron.training import checkpointing

        # imported where it is called, so that the repaired function is the one called
        _require(re.search(r"^\s+from megatron\.core\.dist_checkpointing\.gpt_checkpoint_interop import \(\s*"
                           r"retarget_sharded_state_dict_to_gpt_checkpoint", inspect.getsource(checkpointing),
                           re.MULTILINE) is not None,
                 "megatron.training.checkpointing no longer retargets a hybrid run's state dict at a GPT checkpoint "
                 "through gpt_checkpoint_interop.retarget_sharded_state_dict_to_gpt_checkpoint")
    _require(callable(getattr(training, "get_megatron_optimizer_config", None)),
             "megatron.training.training.get_megatron_optimizer_config is gone")
    _require("get_megatron_optimizer_config(args)" in inspect.getsource(training.setup_model_and_optimizer),
             "setup_model_and_optimizer no longer builds its optimizer config with get_megatron_optimizer_config")
    _require("get_megatron_optimizer(" in inspect.getsource(training.setup_model_and_optimizer),
             "setup_model_and_optimizer no longer builds its optimizer with training.get_megatron_optimizer")
    _has_parameters(initialize.initialize_megatron, ("allow_no_cuda",), "initialize_megatron")
    _require(callable(getattr(initialize, "_warmup_jit_function", None)), "initialize._warmup_jit_function is gone")
    _require(callable(getattr(training, "initialize_megatron", None)), "training.initialize_megatron is gone")
    from megatron.training.datasets import data_samplers

    _has_parameters(data_samplers.build_pretraining_data_loader, ("dataset", "consumed_samples"),
                    "data_samplers.build_pretraining_data_loader")
    _require("build_pretraining_data_loader(" in inspect.getsource(training.build_train_valid_test_data_loaders),
             "training.build_train_valid_test_data_loaders no longer builds its loaders with "
             "build_pretraining_data_loader")
    _has_parameters(training.pretrain, ("cfg_container", "train_valid_test_dataset_provider", "model_type",
                                        "forward_step_func"), "megatron.training.pretrain")
    _require(callable(getattr(dataset_utils, "compile_helpers", None)), "datasets.utils.compile_helpers is gone")
    _has_parameters(training.training_log, ("loss_dict", "total_loss_dict", "learning_rate", "iteration"),
                    "training.training_log")
    _has_parameters(training.save_checkpoint, ("iteration",), "training.save_checkpoint")
    _has_parameters(training.load_checkpoint, ("ddp_model", "optimizer"), "training.load_checkpoint")
    from megatron.training import checkpointing

    if getattr(checkpointing, "HAVE_MEGATRON_FSDP", False):
        from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP

        _require(callable(getattr(MegatronFSDP, "synchronize_param_gather", None)),
                 "MegatronFSDP.synchronize_param_gather is gone")
        _has_parameters(checkpointing.handle_swiglu_in_state_dict, ("model",),
                        "megatron.training.checkpointing.handle_swiglu_in_state_dict")
        _require("handle_swiglu_in_state_dict(" in inspect.getsource(checkpointing.preprocess_fsdp_dtensor_state_dict),
                 "preprocess_fsdp_dtensor_state_dict no longer splits SwiGLU with handle_swiglu_in_state_dict")
    from megatron.training import arguments

    _has_parameters(arguments._print_args, ("title", "args"), "megatron.training.arguments._print_args")
    _require("_print_args(" in inspect.getsource(arguments.validate_args),
             "megatron.training.arguments.validate_args no longer prints its arguments with _print_args")
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank

    _has_parameters(get_batch_on_this_tp_rank, ("batch", "has_cu_seqlens", "is_hybrid_cp", "broadcast_src_rank",
                                                "pipeline_model_parallel_size", "mtp_on_this_rank"),
                    "megatron.core.utils.get_batch_on_this_tp_rank")
    _has_parameters(get_batch_on_this_cp_rank, ("batch", "is_hybrid_cp", "cp_group"),
                    "megatron.core.utils.get_batch_on_this_cp_rank")


CONTRACTS = (
    # the FFN placements run between the attention and MLP steps (before the attention: the public forward)
    Contract("TransformerLayer forward steps", "megatron/transformer_layer.py (before_ffn, inside_ffn)",
             _check_layer_steps),
    Contract("MLP's SwiGLU halves for inside_ffn", "megatron/transformer_layer.py (mlp_with_up_addend)",
             _check_mlp_internals),
    Contract("TransformerLayer constructor", "megatron/transformer_layer.py", _check_layer_constructor),
    Contract("block and GPTModel forwards", "megatron/gpt_model.py, layer_specs.py", _check_block),
    Contract("sharded state dict helpers", "megatron/memory_layer.py", _check_sharded_state_dict_helpers),
    Contract("optimizer internals", "megatron/builder.py, table_optimizer.py, checkpointing.py, step.py",
             _check_optimizer_internals),
    Contract("checkpoint writer queue", "megatron/checkpointing.py", _check_checkpoint_writer_queue),
    Contract("CPU backend targets", "megatron/cpu_backend.py", _check_cpu_backend_targets),
    Contract("Megatron-LM's trainer", "megatron_lm/", _check_trainer),
)


def broken_contracts() -> list[str]:
    """Every contract the installed megatron-core breaks, each as one message (empty: none)."""
    problems = []
    for contract in CONTRACTS:
        try:
            contract.check()
        except UpstreamMoved as moved:
            problems.append(f"{contract.name} (used by fe_megatron/{contract.used_by}): {moved}")
        except (ImportError, AttributeError) as error:
            problems.append(f"{contract.name} (used by fe_megatron/{contract.used_by}): megatron-core "
                            f"{megatron_core_version()}: {error}")
    return problems
