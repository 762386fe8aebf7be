"""Sparse table updates (``optimizer.table_update``, `fe_megatron.tables.sparse_update`).

Each rule is checked against a plain implementation of its formula (and ``lazy_adam`` against
`torch.optim.SparseAdam` itself), on fresh random gradients over a few steps with repeated rows; the
rules leave untouched rows and their state as they are.  Through a memory branch they are
tests/unit/tables/test_stage_tables.py's; across parallel layouts and checkpoints
tests/integration/test_table_update.py's."""

import pytest
import torch

from fe_megatron.tables.sparse_update import LazyAdam, PartialRowwiseAdam, RowwiseAdagrad
from fe_megatron.tables.store import TableStore


ROWS, WIDTH = 50, 8


def random_steps(steps: int = 4, seed: int = 0):
    """Per step: ids (with repeats, a few rows only) and their gradient rows, fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, ROWS, (12,), generator=gen)
        ids[:3] = ids[3]  # one row several times
        out.append((ids, torch.randn(12, WIDTH, generator=gen)))
    return out


def dense_gradient(ids, rows):
    grad = torch.zeros(ROWS, WIDTH)
    grad.index_add_(0, ids, rows)
    return grad


def run_sparse(optimizer_class, weight, steps, **settings):
    store = TableStore(weight.clone(), "device")
    gradients = store.allocate_row_gradients()
    optimizer = optimizer_class([store], **settings)
    for ids, rows in steps:
        gradients.clear()
        half = len(ids) // 2  # two microbatches' pieces
        gradients.add(ids[:half], rows[:half])
        gradients.add(ids[half:], rows[half:])
        optimizer.step()
    return store.weight, optimizer


def test_lazy_adam_is_torch_sparse_adam():
    weight = torch.randn(ROWS, WIDTH)
    steps = random_steps()
    got, _ = run_sparse(LazyAdam, weight, steps, lr=0.05, betas=(0.9, 0.99), eps=1e-8)
    reference = torch.nn.Parameter(weight.clone())
    sparse_adam = torch.optim.SparseAdam([reference], lr=0.05, betas=(0.9, 0.99), eps=1e-8)
    for ids, rows in steps:
        reference.grad = dense_gradient(ids, rows).to_sparse()
        sparse_adam.step()
    torch.testing.assert_close(got, reference.detach(), rtol=1e-6, atol=1e-7)


def test_lazy_adam_decays_only_the_touched_rows():
    weight = torch.randn(ROWS, WIDTH)
    steps = random_steps()
    lr, beta1, beta2, eps, decay = 0.05, 0.9, 0.99, 1e-8, 0.1
    got, optimizer = run_sparse(LazyAdam, weight, steps, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=decay)
    expected, m, v = weight.clone(), torch.zeros(ROWS, WIDTH), torch.zeros(ROWS, WIDTH)
    for step, (ids, rows) in enumerate(steps, start=1):
        grad = dense_gradient(ids, rows)
        for r in torch.unique(ids).tolist():
            m[r] = beta1 * m[r] + (1 - beta1) * grad[r]
            v[r] = beta2 * v[r] + (1 - beta2) * grad[r] ** 2
            expected[r] *= 1 - lr * decay
            expected[r] -= lr * (1 - beta2 ** step) ** 0.5 / (1 - beta1 ** step) * m[r] / (v[r].sqrt() + eps)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[torch.cat([ids for ids, _ in steps])] = False
    assert untouched.any()
    assert torch.equal(got[untouched], weight[untouched])
    assert not optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"][untouched].any()


def test_rowwise_adagrad_is_fbgemm_s_exact_rowwise_rule():
    weight = torch.randn(ROWS, WIDTH)
    steps = random_steps(5, seed=1)
    lr, eps, decay = 0.1, 1e-8, 0.01
    got, optimizer = run_sparse(RowwiseAdagrad, weight, steps, lr=lr, eps=eps, weight_decay=decay)
    expected, momentum = weight.clone(), torch.zeros(ROWS)
    for ids, rows in steps:
        grad = dense_gradient(ids, rows)
        for r in torch.unique(ids).tolist():
            momentum[r] += grad[r].square().mean()
            expected[r] *= 1 - lr * decay
            expected[r] -= lr * grad[r] / (momentum[r].sqrt() + eps)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    torch.testing.assert_close(state["momentum"], momentum)
    assert state["momentum"].shape == (ROWS,) and state["momentum"].dtype == torch.float32


def test_partial_rowwise_adam_is_fbgemm_s_partial_rowwise_rule():
    """FBGEMM's PARTIAL_ROWWISE_ADAM, written out per row as its kernel computes it: the first moment
    per element, the second per row of the row's mean squared gradient, both bias-corrected by the step;
    weight decay decoupled; untouched rows and their state left alone."""
    weight = torch.randn(ROWS, WIDTH)
    steps = random_steps(5, seed=3)
    lr, beta1, beta2, eps, decay = 0.05, 0.9, 0.99, 1e-8, 0.1
    got, optimizer = run_sparse(PartialRowwiseAdam, weight, steps, lr=lr, betas=(beta1, beta2), eps=eps,
                                weight_decay=decay)
    expected, m, v = weight.clone().double(), torch.zeros(ROWS, WIDTH, dtype=torch.float64), \
        torch.zeros(ROWS, dtype=torch.float64)
    for step, (ids, rows) in enumerate(steps, start=1):
        grad = dense_gradient(ids, rows).double()
        for r in torch.unique(ids).tolist():
            m[r] = beta1 * m[r] + (1 - beta1) * grad[r]
            v[r] = beta2 * v[r] + (1 - beta2) * (grad[r] ** 2).mean()
            m_hat, v_hat = m[r] / (1 - beta1 ** step), v[r] / (1 - beta2 ** step)
            expected[r] = expected[r] - lr * (m_hat / (v_hat.sqrt() + eps) + decay * expected[r])
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-6)
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    assert state["exp_avg"].shape == (ROWS, WIDTH) and state["exp_avg_sq"].shape == (ROWS,)
    torch.testing.assert_close(state["exp_avg_sq"], v.float())
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[torch.cat([ids for ids, _ in steps])] = False
    assert untouched.any()
    assert torch.equal(got[untouched], weight[untouched]) and not state["exp_avg_sq"][untouched].any()


@pytest.mark.parametrize("cls", [RowwiseAdagrad, LazyAdam, PartialRowwiseAdam])
def test_bf16_tables_follow_fp32_within_rounding(cls):
    weight = torch.randn(ROWS, WIDTH)
    steps = random_steps(6, seed=2)
    fp32, _ = run_sparse(cls, weight, steps, lr=0.01)
    bf16, _ = run_sparse(cls, weight.bfloat16(), steps, lr=0.01)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, rtol=2e-2, atol=2e-2)
