"""Megatron-LM's trainer (``megatron.training``, megatron-core 0.19 on) as `fe_megatron.megatron_lm` runs it.

No public hook of ``megatron.training.pretrain`` takes the memory branch's pieces, so the run replaces a
few of the trainer's module attributes, each for as long as the run's `PatchScope` is open
(`fe_megatron.megatron_lm.run.run`): the model class its builders construct (only while they build), the
optimizer's parameter-group overrides and the chain it trains with, the log entries, what happens around
a save and a load, the argument dump, and what a host without CUDA needs.  The contract "Megatron-LM's
trainer" (`fe_megatron.megatron.compat.contracts`) checks that each is still where it is replaced.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Callable

import torch

from fe_megatron.megatron.patches import PatchScope


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


def add_trainer_param_group_overrides(scope: PatchScope, overrides: dict) -> None:
    """Megatron-LM's trainer builds its optimizer with ``overrides`` (``{ParamKey:
    ParamGroupOverride}``) added to the standard ones it derives from the arguments
    (``get_megatron_optimizer_config``: no weight decay on biases and norms, the decoupled LR)."""
    from megatron.training import training

    standard = training.get_megatron_optimizer_config

    def with_overrides(args):
        config, config_overrides = standard(args)
        return config, {**(config_overrides or {}), **overrides}

    scope.replace(training, "get_megatron_optimizer_config", with_overrides)


def extend_trainer_optimizer(scope: PatchScope, extend: Callable) -> None:
    """Megatron-LM's trainer hands the optimizer it builds (``get_megatron_optimizer``'s chain) to
    ``extend`` and trains with what that returns (the chain with the tables' member added)."""
    from megatron.training import training

    standard = training.get_megatron_optimizer

    def extended(*args, **kwargs):
        return extend(standard(*args, **kwargs))

    scope.replace(training, "get_megatron_optimizer", extended)


def add_training_log_entries(scope: PatchScope, entries: Callable[[dict, int], dict]) -> None:
    """Megatron-LM's trainer logs ``entries(loss_dict, iteration)`` (``{name: 1-element tensor}``;
    called on every rank after each step, where collectives are safe, with the step's reduced
    losses) beside ``lm loss``: averaged over the log interval, printed and written to TensorBoard
    the same way."""
    from megatron.training import training

    training_log = training.training_log

    def with_entries(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        return training_log({**loss_dict, **entries(loss_dict, iteration)}, total_loss_dict, learning_rate,
                            iteration, *args, **kwargs)

    scope.replace(training, "training_log", with_entries)


def after_each_save(scope: PatchScope, hook: Callable[[int], None]) -> None:
    """``hook(iteration)`` on every rank after Megatron-LM's trainer has saved and committed a checkpoint."""
    from megatron.training import training

    save_checkpoint = training.save_checkpoint

    def save_then_hook(iteration, *args, **kwargs):
        result = save_checkpoint(iteration, *args, **kwargs)
        hook(iteration)
        return result

    scope.replace(training, "save_checkpoint", save_then_hook)


def around_trainer_loads(scope: PatchScope, before: Callable, after: Callable) -> None:
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

    scope.replace(training, "load_checkpoint", load_between_hooks)


def wrap_trainer_checkpointing(scope: PatchScope, save: Callable, load: Callable) -> None:
    """Megatron-LM's trainer saves with ``save(save_checkpoint)`` and loads with ``load(load_checkpoint)``:
    each receives the trainer's function and returns the one it calls instead, with the same parameters
    (``save_checkpoint(iteration, model, optimizer, ...)``, ``load_checkpoint(ddp_model, optimizer, ...)``)."""
    from megatron.training import training

    scope.replace(training, "save_checkpoint", save(training.save_checkpoint))
    scope.replace(training, "load_checkpoint", load(training.load_checkpoint))


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


def repair_fsdp_dtensor_swiglu_lookup(scope: PatchScope) -> None:
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
    scope.replace(checkpointing, "handle_swiglu_in_state_dict", handle_below_wrappers)


@contextlib.contextmanager
def argument_dump_held(held: list):
    """Inside the block, megatron.training's argument validation appends its argument dump (about 850
    lines on rank 0) to ``held`` as ``(title, args)`` instead of printing it; print it with
    `print_argument_dump` once the run's own checks have passed, so that a refusal is not buried under it."""
    from megatron.training import arguments

    with _replaced(arguments, "_print_args", lambda title, args: held.append((title, args))):
        yield held


def print_argument_dump(held: list) -> None:
    from megatron.training import arguments

    for title, args in held:
        arguments._print_args(title, args)


def run_trainer_on_host(scope: PatchScope) -> None:
    """Megatron-LM's trainer on a machine without CUDA: ``pretrain`` initializes Megatron without its
    CUDA assertion (the CPU backend answers the rest, `cpu_backend.enable_cpu_backend(trainer=True)`), and
    what draws from the CPU generator outside the training steps (the JIT warm-up, the data loaders) leaves
    the generator that stands in for the device's alone, so that dropout resumes exactly."""
    from megatron.training import initialize, training

    scope.replace(training, "initialize_megatron",
                  functools.partial(initialize.initialize_megatron, allow_no_cuda=True))
    # The JIT warm-up draws random tensors on the device; on the host they would come from the CPU
    # generator, which initializes the weights, and change them: keep that generator's state.
    warm_up = initialize._warmup_jit_function

    def warm_up_keeping_cpu_rng(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return warm_up(*args, **kwargs)

    scope.replace(initialize, "_warmup_jit_function", warm_up_keeping_cpu_rng)
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

    scope.replace(data_samplers, "build_pretraining_data_loader", build_loader_with_own_generator)
    scope.replace(training, "build_pretraining_data_loader", build_loader_with_own_generator)


def finish_fsdp_param_gathers(model_chunks: list) -> None:
    """Wait for the parameter all-gathers Megatron-FSDP started ahead of a next forward (nothing where a
    chunk is not under Megatron-FSDP). After the last step nothing else waits for them when no evaluation
    follows, and on gloo an unfinished gather kept its transport thread running past the groups' destruction,
    to Python's exit (`fe_megatron.training.distributed.destroy_process_groups`)."""
    for chunk in model_chunks:
        synchronize = getattr(chunk, "synchronize_param_gather", None)
        if callable(synchronize):
            synchronize()


def use_built_dataset_helpers(scope: PatchScope) -> None:
    """The megatron-core wheel ships its dataset index helpers built (``helpers_cpp``) but not the
    Makefile that Megatron-LM's start-up runs to build them, which then fails: build them only where
    they are missing."""
    from megatron.core.datasets import utils

    compile_helpers = utils.compile_helpers

    def compile_if_missing():
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            compile_helpers()

    scope.replace(utils, "compile_helpers", compile_if_missing)
