"""Host memory that a training step frees kept for the next step, not returned to the system.

The tables' host work allocates large buffers every step: a microbatch's gathered rows and their
gradients, the sums per row, the exchanged rows (tens to hundreds of MB each).  glibc's malloc serves
blocks above its mmap threshold (at most 32 MB unless set) with a fresh ``mmap`` and unmaps them on
``free``, so every step touches those pages for the first time again, and the kernel zeroes each one
in a page fault.  On the 340M preset's width, gathering a microbatch's rows took 22 ms, 19 of them page
faults, against 4 ms from memory the process had kept (benchmarks/RESULTS.md, "bench_fbgemm_tables.py").

`keep_freed_host_memory` asks malloc (``mallopt``) to serve blocks below 1 GiB from its heap and to
keep up to 2 GiB free at the heap's top: the memory a step frees is the next step's, already mapped.
A process's resident memory then stays at its peak, which a training step reaches every step anyway.
PyTorch's CPU performance guides reach the same with jemalloc or tcmalloc (``LD_PRELOAD``); this needs
no other library.  Nothing is changed where the user chose already: ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES`` set, another allocator preloaded, or
``FE_MEGATRON_HOST_ALLOCATOR=system``; nor on a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1
OPT_OUT = "FE_MEGATRON_HOST_ALLOCATOR"
_STATE = {"done": None}


def keep_freed_host_memory() -> str:
    """Set malloc to keep freed host memory (see the module docstring), once per process.  Returns a line
    for the run's log saying what was done, or why not."""
    if _STATE["done"] is not None:
        return _STATE["done"]
    _STATE["done"] = _keep()
    return _STATE["done"]


def _keep() -> str:
    chosen = [name for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
              if os.environ.get(name)]
    if os.environ.get(OPT_OUT, "") == "system":
        return f"host allocator: the system's ({OPT_OUT}=system)"
    if chosen:
        return f"host allocator: as set by {', '.join(chosen)}"
    preloaded = os.environ.get("LD_PRELOAD", "")
    if any(name in preloaded for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return f"host allocator: the preloaded one ({preloaded})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):
            return "host allocator: the system's (not glibc)"
        kept = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except OSError:
        return "host allocator: the system's (no C library to configure)"
    if not kept:
        return "host allocator: the system's (malloc refused the thresholds)"
    return (f"host allocator: freed blocks below 1 GiB kept for the next step (malloc's thresholds; "
            f"{OPT_OUT}=system keeps the system's)")
