"""TableAdamW and stochastic rounding: torch's AdamW to the bit on fp32 tables, and bf16 tables
whose tiny updates survive in expectation (where rounding to nearest loses them)."""

import pytest
import torch

from fe_megatron.memory import table_optimizer
from fe_megatron.memory.table_optimizer import TableAdamW
from fe_megatron.memory.table_storage import stochastic_round_to_bf16


def test_fp32_tables_take_torchs_adamw_update_to_the_bit():
    torch.manual_seed(0)
    ours = [torch.randn(50, 8), torch.randn(30, 4)]
    theirs = [p.clone() for p in ours]
    settings = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    opt = TableAdamW([{"params": ours[:1], "weight_decay": 0.1}, {"params": ours[1:], "weight_decay": 0.0}],
                     **settings)
    ref = torch.optim.AdamW([{"params": theirs[:1], "weight_decay": 0.1}, {"params": theirs[1:], "weight_decay": 0.0}],
                            foreach=False, **settings)
    for _ in range(5):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    # the same state layout as torch's AdamW: a checkpoint of one loads into the other
    ref.load_state_dict(opt.state_dict())
    assert torch.equal(ref.state[theirs[0]]["exp_avg"], opt.state[ours[0]]["exp_avg"])


def test_main_grad_is_the_gradient_when_a_table_has_one():
    weight = torch.zeros(4, 2, dtype=torch.bfloat16)
    weight.main_grad = torch.ones(4, 2)
    TableAdamW([weight], lr=0.5, weight_decay=0.0).step()
    assert torch.equal(weight.float(), torch.full((4, 2), -0.5))  # Adam's first step: -lr * sign(grad)


def drift_of_tiny_updates(rounding, monkeypatch) -> float:
    """bf16 rows at 1.0 take 300 Adam steps of about 1e-4 each, 1/78 of a bf16 step at 1.0:
    the mean of the rows minus where exact arithmetic puts them (0.97)."""
    monkeypatch.setattr(table_optimizer, "stochastic_round_to_bf16", rounding)
    weight = torch.ones(8192, 1, dtype=torch.bfloat16)
    weight.grad = torch.ones(8192, 1, dtype=torch.bfloat16)
    opt = TableAdamW([weight], lr=1e-4, weight_decay=0.0, seed=3)
    for _ in range(300):
        opt.step()
    return float(weight.float().mean()) - (1.0 - 300 * 1e-4)


# Each of the 300 roundings of a row moves it by at most one bf16 step (1/128) with zero mean:
# the mean of 8192 rows deviates by about sqrt(300) * (1/128) / 2 / sqrt(8192) = 7.5e-4 (one sigma).
TOLERANCE = 5 * 7.5e-4


def test_stochastic_rounding_keeps_tiny_updates_in_expectation(monkeypatch):
    assert abs(drift_of_tiny_updates(stochastic_round_to_bf16, monkeypatch)) < TOLERANCE


def test_the_same_test_fails_for_round_to_nearest(monkeypatch):
    nearest = lambda values, generator=None: values.to(torch.bfloat16)  # noqa: E731
    assert drift_of_tiny_updates(nearest, monkeypatch) == pytest.approx(0.03)  # the rows never moved


def test_stochastic_rounding_is_unbiased_and_exact_where_bf16_is():
    generator = torch.Generator().manual_seed(0)
    values = torch.full((100_000,), 1.0 + 3 / 1024)  # 3/8 of the way from 1.0 to the next bf16 (1 + 1/128)
    rounded = stochastic_round_to_bf16(values, generator).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 1 / 128}
    assert float(rounded.mean()) == pytest.approx(1.0 + 3 / 1024, abs=5 * (1 / 128) * 0.5 / 100_000 ** 0.5)
    exact = torch.tensor([0.0, -2.5, 3.0, float("inf"), float("-inf")])
    assert torch.equal(stochastic_round_to_bf16(exact, generator).float(), exact)
    assert torch.isnan(stochastic_round_to_bf16(torch.tensor([float("nan")]), generator)).all()


def test_a_resumed_optimizer_rounds_as_the_uninterrupted_one():
    torch.manual_seed(1)
    start = torch.randn(100, 4).to(torch.bfloat16)
    grads = [torch.randn(100, 4).to(torch.bfloat16) for _ in range(4)]

    def run(steps, weight, state=None):
        opt = TableAdamW([weight], lr=1e-3, seed=7)
        if state is not None:
            opt.load_state_dict(state)
        for grad in steps:
            weight.grad = grad
            opt.step()
        return opt

    whole = start.clone()
    run(grads, whole)
    half = start.clone()
    state = run(grads[:2], half).state_dict()
    run(grads[2:], half, state)
    assert torch.equal(whole, half)


def test_other_dtypes_are_refused_by_name():
    with pytest.raises(TypeError, match="TableAdamW updates fp32 or bf16 tables; got a torch.float16 parameter"):
        TableAdamW([torch.zeros(2, 2, dtype=torch.float16)])
