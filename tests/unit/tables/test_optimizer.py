"""TableAdamW and stochastic rounding: torch's AdamW to the bit on fp32 tables and state, bf16 tables
and moments whose tiny updates survive in expectation (where rounding to nearest loses them), and
rounding that depends on an element's global coordinates only."""

import pytest
import torch

from fe_megatron import ops
from fe_megatron.tables.layout import TableLayout
from fe_megatron.tables.optimizer import TableAdamW
from fe_megatron.tables.store import TableStore
from fe_megatron.tables.storage import rounding_keys
from fe_megatron.ops.reference import counter_noise, stochastic_round_to_bf16
from fe_megatron.ops import reference


def trained(weight: torch.Tensor, grad: torch.Tensor = None) -> TableStore:
    """``weight`` in a store with a dense gradient (``grad``, or zeros to fill)."""
    store = TableStore(weight, "device")
    store.allocate_gradient(torch.float32)
    if grad is not None:
        store.main_grad.copy_(grad)
    return store


def test_fp32_tables_take_torchs_adamw_update_to_the_bit():
    torch.manual_seed(0)
    stores = [trained(torch.randn(50, 8)), trained(torch.randn(30, 4))]
    ours = [store.weight for store in stores]
    theirs = [p.clone() for p in ours]
    settings = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    opt = TableAdamW([{"params": stores[:1], "weight_decay": 0.1}, {"params": stores[1:], "weight_decay": 0.0}],
                     **settings)
    ref = torch.optim.AdamW([{"params": theirs[:1], "weight_decay": 0.1}, {"params": theirs[1:], "weight_decay": 0.0}],
                            foreach=False, **settings)
    for _ in range(5):
        for store, b in zip(stores, theirs):
            store.main_grad.copy_(torch.randn_like(store.weight))
            b.grad = store.main_grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    # the same state layout as torch's AdamW: a checkpoint of one loads into the other
    ref.load_state_dict(opt.state_dict())
    assert torch.equal(ref.state[theirs[0]]["exp_avg"], opt.state[ours[0]]["exp_avg"])


def test_the_store_s_gradient_is_the_gradient_and_nothing_hangs_on_the_rows():
    store = trained(torch.zeros(4, 2, dtype=torch.bfloat16), torch.ones(4, 2))
    store.weight.grad = torch.full((4, 2), -1.0, dtype=torch.bfloat16)  # not the table optimizer's: ignored
    optimizer = TableAdamW([store], lr=0.5, weight_decay=0.0)
    optimizer.step()
    assert torch.equal(store.weight.float(), torch.full((4, 2), -0.5))  # Adam's first step: -lr * sign(main_grad)
    assert vars(store.weight) == {}  # no gradient, layout or state set as an attribute of the tensor
    assert optimizer.layouts[store.weight] == TableLayout.whole(0, store.weight)
    with pytest.raises(TypeError, match=r"TableAdamW trains TableStores .*; got a Tensor. Hand it the table as "
                                        r"TableStore\(weight, 'device'\)"):
        TableAdamW([torch.zeros(4, 2)])


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_moments_are_kept_in_the_state_dtype_and_reload_without_loss(state_dtype):
    torch.manual_seed(2)
    store = trained(torch.randn(64, 8).to(torch.bfloat16), torch.randn(64, 8))
    weight = store.weight
    opt = TableAdamW([store], lr=1e-3, state_dtype=state_dtype)
    opt.step()
    expected = {"fp32": torch.float32, "bf16": torch.bfloat16}[state_dtype]
    assert {opt.state[weight][key].dtype for key in ("exp_avg", "exp_avg_sq")} == {expected}
    again = TableAdamW([store], lr=1e-3, state_dtype=state_dtype)
    again.load_state_dict(opt.state_dict())  # torch would cast fp32 moments to the bf16 table's dtype
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(again.state[weight][key], opt.state[weight][key])


def drift_of_tiny_updates(backend: str, state_dtype: str = "fp32") -> float:
    """bf16 rows at 1.0 take 300 Adam steps of about 1e-4 each, 1/78 of a bf16 step at 1.0, on kernel
    ``backend``: the mean of the rows minus where exact arithmetic puts them (0.97)."""
    if backend not in ops.available_backends():
        pytest.skip(f"the {backend} kernels are not built")
    store = trained(torch.ones(8192, 1, dtype=torch.bfloat16), torch.ones(8192, 1))
    opt = TableAdamW([store], lr=1e-4, weight_decay=0.0, state_dtype=state_dtype, seed=3)
    with ops.use_backend(backend):
        for _ in range(300):
            opt.step()
    return float(store.weight.float().mean()) - (1.0 - 300 * 1e-4)


# Each of the 300 roundings of a row moves it by at most one bf16 step (1/128) with zero mean:
# the mean of 8192 rows deviates by about sqrt(300) * (1/128) / 2 / sqrt(8192) = 7.5e-4 (one sigma).
TOLERANCE = 5 * 7.5e-4


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_stochastic_rounding_keeps_tiny_updates_in_expectation(backend, state_dtype):
    assert abs(drift_of_tiny_updates(backend, state_dtype)) < TOLERANCE


def test_the_same_test_fails_for_round_to_nearest(monkeypatch):
    monkeypatch.setattr(reference, "stochastic_round_to_bf16", lambda values, noise: values.to(torch.bfloat16))
    assert drift_of_tiny_updates("torch") == pytest.approx(0.03)  # the rows never moved


def rounding_noise(key, element_ids: torch.Tensor) -> torch.Tensor:
    """The noise a table update of ``key`` = (seed, table, step, tensor) draws for ``element_ids``."""
    return counter_noise(*rounding_keys(key), element_ids)


def test_stochastic_rounding_is_unbiased_and_exact_where_bf16_is():
    values = torch.full((100_000,), 1.0 + 3 / 1024)  # 3/8 of the way from 1.0 to the next bf16 (1 + 1/128)
    rounded = stochastic_round_to_bf16(values, rounding_noise(0, torch.arange(100_000))).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 1 / 128}
    assert float(rounded.mean()) == pytest.approx(1.0 + 3 / 1024, abs=5 * (1 / 128) * 0.5 / 100_000 ** 0.5)
    exact = torch.tensor([0.0, -2.5, 3.0, float("inf"), float("-inf")])
    assert torch.equal(stochastic_round_to_bf16(exact, rounding_noise(1, torch.arange(5))).float(), exact)
    nans = torch.tensor([float("nan")]).repeat(3)
    nans.view(torch.int32)[1] = 0x7FFFFFFF  # a nan whose low bits would carry into the sign
    assert torch.isnan(stochastic_round_to_bf16(nans, torch.full((3,), 0xFFFF))).all()


def test_rounding_noise_is_uniform_and_a_function_of_key_and_id():
    ids = torch.arange(200_000) * 7919 + 3  # scattered ids, as a row shard's global ids are
    noise = rounding_noise((5, 2), ids)
    assert noise.min() >= 0 and noise.max() < 1 << 16
    assert float(noise.float().mean()) / 65536 == pytest.approx(0.5, abs=0.005)
    for bit in range(16):  # every bit is a fair coin
        assert float(((noise >> bit) & 1).float().mean()) == pytest.approx(0.5, abs=0.01)
    assert torch.equal(rounding_noise((5, 2), ids[1000:2000]), noise[1000:2000])  # any subset, same bits
    assert (rounding_noise((5, 3), ids) != noise).float().mean() > 0.99  # another step, other bits


def test_a_row_shard_rounds_as_its_rows_of_the_whole_table():
    """Rows 10-19 and 40-49 of a bf16 table updated as a shard (as a rank of a row-sharded group
    holds them) end bit for bit where the same rows of the whole table end."""
    torch.manual_seed(4)
    whole = torch.randn(64, 6).to(torch.bfloat16)
    grads = [torch.randn(64, 6) for _ in range(3)]
    shard_rows = torch.cat([torch.arange(10, 20), torch.arange(40, 50)])
    shard = whole[shard_rows].clone()
    whole_store = TableStore(whole, "device", TableLayout.whole(7, whole))
    shard_store = TableStore(shard, "device", TableLayout(7, ((10, 10, 0), (40, 10, 10)), 0, 6))
    optimizers = [TableAdamW([whole_store], lr=1e-2, seed=1), TableAdamW([shard_store], lr=1e-2, seed=1)]
    for grad in grads:
        whole_store.main_grad, shard_store.main_grad = grad, grad[shard_rows]
        for opt in optimizers:
            opt.step()
    assert torch.equal(shard, whole[shard_rows])


def test_a_resumed_optimizer_rounds_as_the_uninterrupted_one():
    torch.manual_seed(1)
    start = torch.randn(100, 4).to(torch.bfloat16)
    grads = [torch.randn(100, 4).to(torch.bfloat16) for _ in range(4)]

    def run(steps, weight, state=None):
        store = TableStore(weight, "device")
        opt = TableAdamW([store], lr=1e-3, state_dtype="bf16", seed=7)
        if state is not None:
            opt.load_state_dict(state)
        for grad in steps:
            store.main_grad = grad
            opt.step()
        return opt

    whole = start.clone()
    run(grads, whole)
    half = start.clone()
    state = run(grads[:2], half).state_dict()
    run(grads[2:], half, state)
    assert torch.equal(whole, half)


def test_other_dtypes_and_shapes_are_refused_by_name():
    with pytest.raises(TypeError, match=r"TableAdamW updates fp32 or bf16 tables \[rows, width\]; got a "
                                        r"torch.float16 table"):
        TableAdamW([TableStore(torch.zeros(2, 2, dtype=torch.float16), "device")])
    with pytest.raises(ValueError, match=r"state_dtype 'fp16' is not one of \('fp32', 'bf16'\)"):
        TableAdamW([TableStore(torch.zeros(2, 2), "device")], state_dtype="fp16")
