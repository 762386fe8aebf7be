"""Run megatron.core on CPU with the gloo backend, for development, tests and the demo.

Call `enable_cpu_backend()` once, before building models. On a machine with CUDA it does
nothing and returns False, so the same script runs unchanged on GPUs.

megatron.core assumes CUDA in a handful of places; each is answered here, scoped to
megatron.core's own modules (user code and torch itself are left alone):

1. Device RNG: the tensor-parallel RNG tracker and activation recompute save and restore
   the CUDA generator. On CPU the CPU generator stands in for it
   (`_get_cuda_rng_state` / `_set_cuda_rng_state` and `torch.cuda.{get_rng_state,
   set_rng_state, manual_seed}`), with the same fork/restore semantics.
2. `torch.cuda.current_device()` (DDP grad buffers, GlobalMemoryBuffer, p2p, the
   distributed optimizer) answers the CPU device.
3. Tensors created with ``device='cuda'`` (loss scale, clip_grads, l2 norm, schedules'
   token count) are created on the CPU.
4. Legacy type-string checks (``param.type() == 'torch.cuda.FloatTensor'`` in the
   optimizers and clip_grads) see CUDA-style names for CPU tensors, and ``tensor.cuda()``
   (tied-embedding sync across pipeline stages, optimizer state loading) returns the
   tensor itself -- both only when the caller is megatron.core.
5. `torch.cuda.synchronize()` (dist checkpoint save, p2p) is a no-op.

Each megatron module in `_MEGATRON_MODULES` gets a `torch` proxy that forwards every
attribute to torch except the few above. The default causal mask is built on CUDA by
megatron; pass an explicit ``attention_mask`` (as fe_megatron's trainer does).
"""

from __future__ import annotations

import importlib
import logging
import sys

import torch

_MEGATRON_MODULES = [
    "megatron.core.utils", "megatron.core.parallel_state", "megatron.core.timers",
    "megatron.core.rerun_state_machine", "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data", "megatron.core.tensor_parallel.utils",
    "megatron.core.distributed.distributed_data_parallel", "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads", "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.utils", "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_layer", "megatron.core.transformer.attention",
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
]
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint", "zeros_like",
              "ones_like", "empty_like", "full_like", "as_tensor")
_enabled = False


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"):
        return torch.device("cpu")
    return device


class _CudaOnCpu:
    """Stands in for ``torch.cuda`` inside megatron.core modules."""

    default_generators = (torch.default_generator,)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(*_args, **_kwargs):
        return None

    @staticmethod
    def is_available():
        return False

    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)
    manual_seed = staticmethod(torch.manual_seed)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """A ``torch`` that creates CPU tensors where megatron.core asks for CUDA ones."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args, _fn=attr, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return _fn(*args, **kwargs)

            return factory
        return attr


def _get_device_rng_state(device=-1, clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_device_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _called_from_megatron() -> bool:
    return sys._getframe(2).f_globals.get("__name__", "").startswith("megatron.core")


def _cpu_tensor_cuda(original):
    def cuda(self, *args, **kwargs):
        if self.device.type == "cpu" and _called_from_megatron():
            return self
        return original(self, *args, **kwargs)

    return cuda


def _cuda_style_type(original):
    names = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
             torch.bfloat16: "torch.cuda.BFloat16Tensor"}

    def type_(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in names and _called_from_megatron():
            return names[self.dtype]
        return original(self, *args, **kwargs)

    return type_


def enable_cpu_backend() -> bool:
    """Make megatron.core run on CPU (gloo). Returns True if enabled, False on a CUDA machine."""
    global _enabled
    if torch.cuda.is_available():
        return False
    if _enabled:
        return True
    proxy = _TorchOnCpu()
    for name in _MEGATRON_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional part of megatron.core that this install lacks
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _get_device_rng_state
    mcore_random._set_cuda_rng_state = _set_device_rng_state
    # The CPU generator stands in for the device generator, so megatron's check that the
    # CPU RNG is untouched inside a tracker fork would warn on every fork.
    logging.getLogger(mcore_random.__name__).setLevel(logging.ERROR)
    torch.Tensor.type = _cuda_style_type(torch.Tensor.type)
    torch.Tensor.cuda = _cpu_tensor_cuda(torch.Tensor.cuda)
    _enabled = True
    return True

