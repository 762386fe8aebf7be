"""What the kernel tests share: the compiled backends, the device each runs on (skipping, with the
reason, where a backend is not built here), problem sizes that suit Triton's CPU interpreter,
duplicate-heavy lookups of a table, and a thread count for a block (tests/unit/ops/test_kernels.py,
tests/unit/megatron/test_main_grad.py, tests/integration/test_fresh_interpreter.py)."""

import contextlib

import pytest
import torch

from fe_megatron import ops

COMPILED = ("cpp", "cuda", "triton")
CUDA = torch.cuda.is_available()
SKIP_REASON = {
    "cpp": "the C++ extension is not built",
    "cuda": "needs a CUDA device and the _C_cuda extension (built by setup.py where torch has CUDA)",
    "triton": "needs Triton with a GPU, or TRITON_INTERPRET=1 on CPU",
}
DEVICE = {"torch": "cuda" if CUDA else "cpu", "cpp": "cpu", "cuda": "cuda", "triton": "cuda" if CUDA else "cpu"}


def device_of(backend: str) -> torch.device:
    if backend not in ops.available_backends():
        pytest.skip(f"backend {backend!r}: {SKIP_REASON[backend]}")
    return torch.device(DEVICE[backend])


def small(backend: str, large: int, interpreted: int) -> int:
    """Problem size: Triton's interpreter pays per program and per loop step, so it gets less."""
    return interpreted if backend == "triton" and not CUDA else large


@contextlib.contextmanager
def intra_op_threads(count: int):
    """torch's (and the C++ kernels') intra-op thread count inside the block: the tests run one thread per
    process (tests/conftest.py), and a test of multi-threaded code sets its own."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def duplicate_heavy_indices(rows: int, count: int, device) -> torch.Tensor:
    """Random rows plus a hot row that spans many chunks, a run at the very end, and isolated rows."""
    indices = torch.randint(0, rows, (count,))
    hot = torch.rand(count) < 0.3
    indices[hot] = 7
    indices[-5:] = rows - 1
    return indices.to(device)


def two_microbatches_of_a_table(backend: str, device) -> tuple:
    """``(weight, backward, expected)``: a fresh random table [97, 40], ``backward()`` running two
    microbatches' lookups of duplicate-heavy rows through ``backend`` and back, and the gradient the torch
    reference gives them (``weight.grad`` is left empty)."""
    rows, width = 97, 40
    weight = torch.randn(rows, width, device=device, requires_grad=True)
    batches = [duplicate_heavy_indices(rows, small(backend, 3000, 300), device).view(-1, 3) for _ in range(2)]
    upstream = [torch.randn(*b.shape, width, device=device) for b in batches]

    def backward(through: str = backend) -> None:
        with ops.use_backend(through):
            for idx, up in zip(batches, upstream):
                (ops.gather_rows(weight, idx) * up).sum().backward()

    backward("torch")
    expected, weight.grad = weight.grad.clone(), None
    return weight, backward, expected
