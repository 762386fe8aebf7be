"""Megatron's fused accumulation of a table's gradient into ``main_grad``
(`fe_megatron.megatron.main_grad`), which the adapter registers with the core's kernels: the core
itself knows nothing of Megatron's gradient protocol (tests/unit/test_architecture.py)."""

import pytest
import torch

import fe_megatron.megatron  # noqa: F401  (registers the sink, as every use of the adapter does)
from fe_megatron import ops
from fe_megatron.megatron.main_grad import accumulate_into_main_grad
from tests.unit.ops.test_kernels import COMPILED, device_of, duplicate_heavy_indices, small


@pytest.mark.parametrize("backend", ("torch",) + COMPILED)
def test_a_table_s_rows_go_into_main_grad_and_autograd_gets_a_placeholder(backend):
    """Two microbatches accumulate into ``main_grad`` (on top of what it held), ``grad_added_to_main_grad``
    is set, and with ``zero_out_wgrad`` the placeholder autograd gets is zeros; a table without the
    protocol's attributes gets a dense gradient."""
    device = device_of(backend) if backend != "torch" else torch.device("cpu")
    rows, width = 97, 40
    weight = torch.randn(rows, width, device=device, requires_grad=True)
    batches = [duplicate_heavy_indices(rows, small(backend, 3000, 300), device).view(-1, 3) for _ in range(2)]
    upstream = [torch.randn(*b.shape, width, device=device) for b in batches]
    with ops.use_backend("torch"):
        for idx, up in zip(batches, upstream):
            (ops.gather_rows(weight, idx) * up).sum().backward()
    expected, weight.grad = weight.grad.clone(), None

    start = torch.randn(rows, width, device=device)
    weight.main_grad, weight.grad_added_to_main_grad, weight.zero_out_wgrad = start.clone(), False, True
    with ops.use_backend(backend):
        for idx, up in zip(batches, upstream):
            (ops.gather_rows(weight, idx) * up).sum().backward()
    assert weight.grad_added_to_main_grad is True
    assert torch.equal(weight.grad, torch.zeros_like(weight))  # zero_out_wgrad: the placeholder is zeros
    accumulated = start + expected
    torch.testing.assert_close(weight.main_grad, accumulated, rtol=1e-6, atol=1e-6 * float(accumulated.abs().max()))


def test_the_sink_leaves_tables_outside_megatron_s_ddp_alone():
    weight = torch.randn(5, 3)
    assert accumulate_into_main_grad(weight, lambda out: pytest.fail("no main_grad to add into")) is None
    weight.main_grad = torch.zeros(5, 3)  # a main_grad without DDP's flag: not Megatron's protocol
    assert accumulate_into_main_grad(weight, lambda out: pytest.fail("no flag")) is None
