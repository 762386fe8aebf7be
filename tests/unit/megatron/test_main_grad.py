"""Megatron's fused accumulation of a table's gradient into ``main_grad``
(`fe_megatron.megatron.main_grad`), which a run registers with the core's kernels for its length: the
core itself knows nothing of Megatron's gradient protocol (tests/unit/test_architecture.py)."""

import pytest
import torch

from fe_megatron import ops
from fe_megatron.megatron.main_grad import accumulate_into_main_grad, use_main_grad_accumulation
from fe_megatron.megatron.patches import PatchScope
from tests.helpers.kernels import COMPILED, device_of, two_microbatches_of_a_table


@pytest.fixture
def main_grad_accumulation():
    """The sink registered as a run registers it (`fe_megatron.megatron.parallel.initialize`), and gone after."""
    before = ops.weight_gradient_sinks()
    with PatchScope() as scope:
        use_main_grad_accumulation(scope)
        assert accumulate_into_main_grad in ops.weight_gradient_sinks()
        yield
    assert ops.weight_gradient_sinks() == before


@pytest.mark.parametrize("backend", ("torch",) + COMPILED)
def test_a_table_s_rows_go_into_main_grad_and_autograd_gets_a_placeholder(backend, main_grad_accumulation):
    """Two microbatches accumulate into ``main_grad`` (on top of what it held), ``grad_added_to_main_grad``
    is set, and with ``zero_out_wgrad`` the placeholder autograd gets is zeros."""
    device = device_of(backend) if backend != "torch" else torch.device("cpu")
    weight, backward, expected = two_microbatches_of_a_table(backend, device)
    start = torch.randn(weight.shape, device=device)
    weight.main_grad, weight.grad_added_to_main_grad, weight.zero_out_wgrad = start.clone(), False, True
    backward()
    assert weight.grad_added_to_main_grad is True
    assert torch.equal(weight.grad, torch.zeros_like(weight))  # zero_out_wgrad: the placeholder is zeros
    accumulated = start + expected
    torch.testing.assert_close(weight.main_grad, accumulated, rtol=1e-6, atol=1e-6 * float(accumulated.abs().max()))


def test_the_sink_leaves_tables_outside_megatron_s_ddp_alone():
    weight = torch.randn(5, 3)
    assert accumulate_into_main_grad(weight, lambda out: pytest.fail("no main_grad to add into")) is None
    weight.main_grad = torch.zeros(5, 3)  # a main_grad without DDP's flag: not Megatron's protocol
    assert accumulate_into_main_grad(weight, lambda out: pytest.fail("no flag")) is None
