"""Sparse table updates (``optimizer.table_update``, `fe_megatron.tables.sparse_update`) and the
table plan (`fe_megatron.tables.plan`).

Each rule is checked against a plain implementation of its formula (and ``lazy_adam`` against
`torch.optim.SparseAdam` itself), on fresh random gradients over a few steps with repeated rows;
through a memory branch, the row-wise gradient a store keeps equals autograd's dense gradient on
the touched rows; the rules leave untouched rows and their state as they are; and the plan
decides who trains the tables as docs/tables.md says.  Equivalence across parallel layouts and
checkpoints is tested through Megatron in tests/test_row_sharding.py and through fe-pretrain
below."""

import copy

import pytest
import torch

from fe_megatron.memory import FactorEngram
from fe_megatron.tables.managed import ManagedTables
from fe_megatron.tables.plan import TablePlan
from fe_megatron.tables.sparse_update import LazyAdam, RowwiseAdagrad
from fe_megatron.tables.store import RowGradients
from fe_megatron.training.config import OptimizerArgs
from tests.helpers.configs import small_config
from tests.helpers.torchrun_util import torchrun

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
    weight = weight.clone()
    weight.row_gradients = RowGradients(WIDTH, weight.device)
    optimizer = optimizer_class([weight], **settings)
    for ids, rows in steps:
        weight.row_gradients.clear()
        half = len(ids) // 2  # two microbatches' pieces
        weight.row_gradients.add(ids[:half], rows[:half])
        weight.row_gradients.add(ids[half:], rows[half:])
        optimizer.step()
    return weight, optimizer


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


@pytest.mark.parametrize("update", ["rowwise_adagrad", "lazy_adam"])
def test_bf16_tables_follow_fp32_within_rounding(update):
    weight = torch.randn(ROWS, WIDTH)
    steps = random_steps(6, seed=2)
    cls = RowwiseAdagrad if update == "rowwise_adagrad" else LazyAdam
    fp32, _ = run_sparse(cls, weight, steps, lr=0.01)
    bf16, _ = run_sparse(cls, weight.bfloat16(), steps, lr=0.01)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("update", ["rowwise_adagrad", "lazy_adam"])
@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_branch_s_row_gradients_are_autograd_s_on_the_touched_rows(update, placement):
    """The store keeps the gradient by row; the update it drives equals the rule applied to
    autograd's dense gradient of the same branch, and rows no position read do not move."""
    config = small_config()
    branch = FactorEngram(config, layer_index=config.layers[0])
    with torch.no_grad():
        branch.value_proj.weight.normal_(std=0.05)
    stored = copy.deepcopy(branch)
    stored.config = stored.config.replace(table_placement=placement)
    args = OptimizerArgs(lr=0.05, weight_decay=0.1)
    tables = ManagedTables({"branch": stored}, args, update=update)
    before = stored.tables.weight.clone()
    reference = branch.tables.weight
    reference_optimizer = (RowwiseAdagrad([reference], lr=0.05, eps=args.eps, weight_decay=0.1)
                           if update == "rowwise_adagrad" else
                           LazyAdam([reference], lr=0.05, betas=(args.beta1, args.beta2), eps=args.eps,
                                    weight_decay=0.1))
    reference.row_gradients = RowGradients(reference.shape[1], reference.device)
    for step in range(3):
        hidden = torch.randn(2, 16, config.hidden_size)
        ids = torch.randint(0, config.vocab_size, (2, 16))
        ids[0, :8] = 3
        for model in (branch, stored):
            memory, l1 = model(hidden, ids)
            (memory.square().sum() + l1.sum()).backward()
        touched = reference.grad.abs().sum(dim=1).nonzero().flatten()
        reference.row_gradients.clear()
        reference.row_gradients.add(touched, reference.grad[touched])
        reference_optimizer.step()
        reference.grad = None
        tables.step()
        tables.zero_grad()
    torch.testing.assert_close(stored.tables.weight, reference.detach(), rtol=1e-5, atol=1e-6)
    moved = (stored.tables.weight != before).any(dim=1)
    assert 0 < int(moved.sum()) < before.shape[0] // 2  # the rows read, not the table


def test_the_sparse_gradient_norm_and_clip_are_the_dense_ones():
    config = small_config()
    branch = FactorEngram(config, layer_index=config.layers[0])
    with torch.no_grad():
        branch.value_proj.weight.normal_(std=0.05)
    dense, sparse = copy.deepcopy(branch), copy.deepcopy(branch)
    dense_tables = ManagedTables({"b": dense}, OptimizerArgs())
    sparse_tables = ManagedTables({"b": sparse}, OptimizerArgs(), update="rowwise_adagrad")
    hidden, ids = torch.randn(2, 16, config.hidden_size), torch.randint(0, config.vocab_size, (2, 16))
    for model in (dense, sparse):
        memory, l1 = model(hidden, ids)
        (memory.square().sum() + l1.sum()).backward()
    assert sparse_tables.grad_norm() == pytest.approx(dense_tables.grad_norm(), rel=1e-6)
    sparse_tables.clip(0.5)
    ids_, rows = sparse.tables.store.row_gradients.coalesce()
    torch.testing.assert_close(rows, 0.5 * dense.tables.store.main_grad[ids_])


# ----------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("settings, engine, trainer, mode", [
    ({}, "megatron", "engine", "parameters"),
    ({"bf16_run": True}, "megatron", "stores", "stores"),
    ({"stage_without_memory": True}, "megatron", "stores", "stores"),
    ({"dtype": "bf16"}, "megatron", "stores", "stores"),
    ({"update": "rowwise_adagrad"}, "megatron", "stores", "stores"),
    ({"update": "lazy_adam", "sharding": "rows"}, "megatron", "stores", "stores"),
    ({"sharding": "rows"}, "megatron", "stores", "stores"),
    ({"expert_parallel": 2}, "megatron", "stores", "stores"),
    ({}, "deepspeed", "engine", "zero"),
    ({"bf16_run": True, "stage_without_memory": True}, "deepspeed", "engine", "zero"),
    ({"sharding": "zero"}, "deepspeed", "engine", "zero"),
    ({"sharding": "rows"}, "deepspeed", "stores", "rows"),
    ({"placement": "host"}, "deepspeed", "stores", "replicated"),
    ({"update": "lazy_adam"}, "deepspeed", "stores", "replicated"),
    ({"state_dtype": "bf16", "sharding": "rows"}, "deepspeed", "stores", "rows"),
])
def test_the_plan_decides_who_trains_the_tables(settings, engine, trainer, mode):
    plan = TablePlan.resolve(engine, **settings)
    assert (plan.trainer, plan.mode) == (trainer, mode)
    assert bool(plan.reasons) == (trainer == "stores")
    line = plan.describe()
    assert line.startswith("tables ") and ("in stores because of" in line) == plan.in_stores


def test_the_plan_counts_the_state_each_rule_keeps():
    adamw, adagrad, lazy = (TablePlan.resolve(update=u) for u in ("adamw", "rowwise_adagrad", "lazy_adam"))
    assert (adamw.gradient_bytes_per_parameter(), adamw.state_bytes_per_parameter(128)) == (4, 8)
    assert (adagrad.gradient_bytes_per_parameter(), adagrad.state_bytes_per_parameter(128)) == (0, 4 / 128)
    assert (lazy.gradient_bytes_per_parameter(), lazy.state_bytes_per_parameter(128)) == (0, 8)
    with pytest.raises(ValueError, match="'sgd' is not one of"):
        TablePlan.resolve(update="sgd")


# ----------------------------------------------------------------------------- Megatron, library level
def check_sharding(*args, nproc: int):
    out = torchrun("check_row_sharding.py", *args, nproc=nproc)
    assert "0 failures" in out


@pytest.mark.distributed
def test_rowwise_adagrad_trains_alike_at_every_layout_and_resumes_across_them(reference, tmp_path):
    """Through Megatron's optimizer chain (clipping by one global norm, the scheduler's learning
    rate): whole tables at DP=1 against DP=2 replicas (their touched rows' union all-reduced),
    DP=2 row shards, TP=2 (a row's squares summed over its columns), and the DP=2 row-sharded and
    TP=2 step-1 checkpoints resumed at DP=1: losses, gradient norms and every weight within 1e-5."""
    init, record, final = str(reference / "init"), str(tmp_path / "dp1.json"), str(tmp_path / "dp1_final")
    update = ("--table-update", "rowwise_adagrad")
    check_sharding("--tables", "replicated", *update, "--init", init, "--steps", "0:3", "--record", record,
                   "--save-final", final, nproc=1)
    compare = ("--compare", record, "--compare-final", final)
    check_sharding("--tables", "replicated", *update, "--init", init, "--steps", "0:3", *compare, nproc=2)
    check_sharding("--tables", "rows", *update, "--init", init, "--steps", "0:3", *compare, "--save-step", "1",
                   str(tmp_path / "rows_step1"), nproc=2)
    # the per-row state is saved as one value per row, [table rows, 1], at every layout
    from fe_megatron.convert.megatron_reader import DistCheckpoint

    saved = DistCheckpoint(str(tmp_path / "rows_step1" / "iter_0000001")).metadata
    tables = {name: tuple(meta.size) for name, meta in saved.items() if name.endswith("memory.tables.weight")
              and not name.startswith("optimizer.")}
    assert tables and not any(name.startswith("optimizer.state.momentum.") for name in saved)
    for name, (rows, _) in tables.items():
        assert tuple(saved[f"optimizer.state.row_momentum.{name}"].size) == (rows, 1)
    check_sharding("--tables", "replicated", "--tp", "2", *update, "--init", init, "--steps", "0:3", *compare,
                   "--save-step", "1", str(tmp_path / "tp2_step1"), nproc=2)
    for saved in ("rows_step1", "tp2_step1"):  # both reshard to whole tables on one rank
        check_sharding("--tables", "replicated", *update, "--load", str(tmp_path / saved), "--steps", "1:3",
                       *compare, nproc=1)


@pytest.mark.distributed
def test_lazy_adam_in_host_memory_trains_as_on_the_device_and_resumes(reference, tmp_path):
    init, record, final = str(reference / "init"), str(tmp_path / "dp1.json"), str(tmp_path / "dp1_final")
    update = ("--table-update", "lazy_adam")
    check_sharding("--tables", "replicated", *update, "--init", init, "--steps", "0:3", "--record", record,
                   "--save-final", final, nproc=1)
    compare = ("--compare", record, "--compare-final", final)
    check_sharding("--tables", "rows", "--placement", "host", *update, "--init", init, "--steps", "0:3", *compare,
                   "--save-step", "1", str(tmp_path / "rows_step1"), nproc=2)
    check_sharding("--tables", "replicated", *update, "--load", str(tmp_path / "rows_step1"), "--steps", "1:3",
                   *compare, nproc=1)
