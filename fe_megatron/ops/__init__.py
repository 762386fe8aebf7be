"""One dispatch for every kernel: ``ngram_hash`` and ``gather_rows``.

Backends (``torch`` is always present and is the reference; faster ones register
themselves when they are built): ``torch``, ``cpp``, ``cuda``, ``triton``.  With no
forcing, the fastest backend available for the tensors' device is used; force one with
``use_backend(name)``.
"""

import contextlib
import threading

import torch

from fe_megatron.ops import reference

_ORDER = ("torch", "cpp", "cuda", "triton")
# preference per device type, fastest first
_PREFERENCE = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpp", "torch")}
_BACKENDS = {"torch": reference}
_state = threading.local()


def register_backend(name: str, module) -> None:
    """Make ``module`` (with ``ngram_hash`` and ``gather_rows``) available as ``name``."""
    if name not in _ORDER:
        raise ValueError(f"unknown backend {name!r}; expected one of {_ORDER}")
    _BACKENDS[name] = module


def available_backends() -> list:
    """Names of the backends that are built and importable here, from torch, cpp, cuda, triton."""
    return [name for name in _ORDER if name in _BACKENDS]


@contextlib.contextmanager
def use_backend(name: str):
    """Force one backend inside the ``with`` block."""
    if name not in _BACKENDS:
        raise ValueError(f"backend {name!r} is not available here; available: {available_backends()}")
    previous = getattr(_state, "forced", None)
    _state.forced = name
    try:
        yield
    finally:
        _state.forced = previous


def current_backend(device: torch.device) -> str:
    forced = getattr(_state, "forced", None)
    if forced is not None:
        return forced
    for name in _PREFERENCE.get(device.type, ("torch",)):
        if name in _BACKENDS:
            return name
    return "torch"


def ngram_hash(token_ids, multipliers, moduli, offsets, pad_id: int):
    """See `fe_megatron.ops.reference.ngram_hash`."""
    backend = _BACKENDS[current_backend(token_ids.device)]
    return backend.ngram_hash(token_ids, multipliers, moduli, offsets, pad_id)


def gather_rows(weight, indices):
    """See `fe_megatron.ops.reference.gather_rows`."""
    backend = _BACKENDS[current_backend(weight.device)]
    return backend.gather_rows(weight, indices)
