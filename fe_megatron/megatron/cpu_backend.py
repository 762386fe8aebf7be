"""Run megatron.core on CPU with the gloo backend, for development, tests and the demo.

`enable_cpu_backend(scope=...)`, before building models, installs what follows into a
`fe_megatron.megatron.patches.PatchScope`, which undoes all of it when it closes: fe-pretrain's
Megatron engine calls it when it starts (`fe_megatron.megatron.parallel.initialize`, undone by
``shutdown``), Megatron-LM's trainer for its run (`fe_megatron.megatron_lm.run`).  On a machine with
CUDA it does nothing and returns False, so the same script runs unchanged on GPUs.  Importing this
module changes nothing.

megatron.core assumes CUDA in a handful of places; each is answered here for megatron's own
callers (megatron.core, and megatron.training with ``trainer=True``); user code sees torch as it is:

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
   tensor itself.  These two replace ``torch.Tensor.type`` and ``torch.Tensor.cuda`` while the
   scope is open, and answer differently only when the caller is megatron's.
5. `torch.cuda.synchronize()` (dist checkpoint save, p2p) is a no-op.
6. CUDA streams and events (``torch.cuda.current_stream()``, ``torch.cuda.stream(...)``,
   ``torch.cuda.Stream``/``Event``: DDP's gradient sync from megatron-core 0.19 on) are host
   stand-ins: on the CPU every operation has finished when it returns, so waiting is a no-op.

Each megatron module in `fe_megatron.megatron.compat.CPU_BACKEND_MODULES` (and, with ``trainer=True``,
`CPU_TRAINER_MODULES`) gets a `torch` proxy that forwards every attribute to torch except the few
above; the device RNG functions are replaced through `compat.replace_device_rng_state_functions`
(`fe_megatron.megatron.compat.cpu` has every target). The default causal mask is built on CUDA by
megatron; pass an explicit ``attention_mask`` (as fe_megatron's trainer does).
"""

from __future__ import annotations

import sys
import types
from typing import Optional

import torch

from fe_megatron.megatron import patches
from fe_megatron.megatron.patches import PatchScope

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint", "zeros_like",
              "ones_like", "empty_like", "full_like", "as_tensor")


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"):
        return torch.device("cpu")
    return device


class _HostEvent:
    """A CUDA event on the host: CPU work is complete when it returns, so every wait is over."""

    def __init__(self, *_args, **_kwargs):
        pass

    def record(self, *_args, **_kwargs):
        return None

    def wait(self, *_args, **_kwargs):
        return None

    def synchronize(self):
        return None

    def query(self) -> bool:
        return True


class _HostStream(_HostEvent):
    """A CUDA stream on the host (see `_HostEvent`)."""

    device = torch.device("cpu")

    def wait_event(self, *_args, **_kwargs):
        return None

    def wait_stream(self, *_args, **_kwargs):
        return None

    def record_event(self, event=None):
        return event if event is not None else _HostEvent()

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        return False


class _CudaOnCpu:
    """Stands in for ``torch.cuda`` inside megatron.core modules."""

    default_generators = (torch.default_generator,)
    Stream = _HostStream
    Event = _HostEvent

    @staticmethod
    def current_stream(*_args, **_kwargs):
        return _HostStream()

    @staticmethod
    def default_stream(*_args, **_kwargs):
        return _HostStream()

    @staticmethod
    def stream(*_args, **_kwargs):
        return _HostStream()

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return False

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


class _TrainerCudaOnCpu(_CudaOnCpu):
    """``torch.cuda`` inside megatron.training (Megatron-LM's trainer): the host is its one device.

    The trainer sets up process groups and seeds only where ``device_count() > 0``, and sets the
    device, empties caches and reads memory statistics there; on the host these have nothing to do.
    """

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(*_args, **_kwargs):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def get_device_name(*_args, **_kwargs) -> str:
        return "cpu"

    @staticmethod
    def memory_allocated(*_args, **_kwargs) -> int:
        return 0

    @staticmethod
    def get_device_capability(*_args, **_kwargs) -> tuple:
        return (0, 0)  # no GPU architecture: the trainer takes its pre-Hopper paths

    @staticmethod
    def get_device_properties(*_args, **_kwargs):
        return types.SimpleNamespace(name="cpu", major=0, minor=0, total_memory=0, multi_processor_count=0)

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated


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


class _HostDeviceType(type):
    """``torch.device`` where a CUDA device means the host: ``torch.device(f"cuda:{torch.cuda.current_device()}")``
    (Megatron-FSDP) reads "cuda:cpu" through this backend's ``current_device``."""

    def __call__(cls, spec, *args):
        if isinstance(spec, str) and spec.startswith("cuda"):
            return torch.device("cpu")
        return _cpu_device(torch.device(spec, *args))

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, torch.device)


class _HostDevice(metaclass=_HostDeviceType):
    pass


def _host_device_mesh(from_group):
    """``DeviceMesh.from_group`` whose meshes are the host's (Megatron-FSDP asks for "cuda" ones, whose
    DTensors would initialize CUDA)."""
    def host_mesh(group, device_type="cuda", *args, **kwargs):
        return from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    return host_mesh


class _TrainerTorchOnCpu(_TorchOnCpu):
    cuda = _TrainerCudaOnCpu()
    device = _HostDevice


def _get_device_rng_state(device=-1, clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_device_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _called_from_megatron() -> bool:
    return sys._getframe(2).f_globals.get("__name__", "").startswith(("megatron.core", "megatron.training"))


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


def enable_cpu_backend(trainer: bool = False, scope: Optional[PatchScope] = None) -> bool:
    """Make megatron.core run on CPU (gloo) until ``scope`` closes. Returns True if enabled, False on a
    CUDA machine (where nothing is installed).

    ``scope`` defaults to the innermost open `PatchScope`; outside every scope (a script of one's own
    that calls this bare) the backend stays installed until the process exits.  A scope around
    ``scope`` that enabled it already keeps it, and nothing is installed twice.

    ``trainer=True`` also answers megatron.training's CUDA assumptions (Megatron-LM's trainer, run
    by `fe_megatron.megatron_lm`; megatron-core 0.19 on): its modules in
    `fe_megatron.megatron.compat.CPU_TRAINER_MODULES` see the host as their one device."""
    if torch.cuda.is_available():
        return False
    scope = scope or patches.active()
    scope.install("cpu backend: megatron.core", _install_core)
    if trainer:
        scope.install("cpu backend: megatron.training", _install_trainer)
    return True


def _install_core(scope: PatchScope) -> None:
    from fe_megatron.megatron import compat

    compat.replace_module_torch(scope, compat.CPU_BACKEND_MODULES, _TorchOnCpu())
    compat.replace_device_rng_state_functions(scope, _get_device_rng_state, _set_device_rng_state)
    compat.split_sizes_as_numpy_on_the_host(scope)  # the all-to-all MoE dispatcher's split sizes
    compat.quiet_rng_tracker_warnings(scope)
    scope.replace(torch.Tensor, "type", _cuda_style_type(torch.Tensor.type))
    scope.replace(torch.Tensor, "cuda", _cpu_tensor_cuda(torch.Tensor.cuda))


def _install_trainer(scope: PatchScope) -> None:
    from fe_megatron.megatron import compat

    compat.replace_module_torch(scope, compat.CPU_TRAINER_MODULES, _TrainerTorchOnCpu())
    compat.build_fsdp_device_meshes_on(scope, _host_device_mesh)
