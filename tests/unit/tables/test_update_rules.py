"""The registry of table update rules (`fe_megatron.tables.update_rules`): each rule is one entry, and
what every reader says about a rule (its bytes, its sparsity, its checkpoint keys, whether a resume may
change it, the choices of each command line) comes from that entry."""

import argparse

import pytest
import torch

from fe_megatron.checkpoint.resume_guard import compare
from fe_megatron.planning.rank_memory import TableStorage
from fe_megatron.tables.plan import TablePlan
from fe_megatron.tables.store import TableStore
from fe_megatron.tables.update_rules import RULES, TABLE_UPDATES, update_rule
from fe_megatron.training.config import OptimizerArgs

ROWS, WIDTH = 40, 16


def stepped_optimizer(rule, state_dtype: str):
    """The rule's optimizer over one random table, after one step of fresh random gradients."""
    gen = torch.Generator().manual_seed(7)
    store = TableStore(torch.randn(ROWS, WIDTH, generator=gen), "device")
    ids = torch.randint(0, ROWS, (24,), generator=gen)
    grad = torch.randn(24, WIDTH, generator=gen)
    if rule.sparse:
        store.allocate_row_gradients().add(ids, grad)
    else:
        store.allocate_gradient(torch.float32).index_add_(0, ids, grad)
    optimizer = rule.build([store], OptimizerArgs(lr=1e-2), state_dtype, seed=0)
    optimizer.step()
    return optimizer, store.weight


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", TABLE_UPDATES)
def test_the_declared_state_is_the_state_the_optimizer_keeps(name, state_dtype):
    """The bytes the entry declares (what the plan and fe-plan count) are the bytes the optimizer holds, and
    its per-row state is one fp32 value per row."""
    rule = update_rule(name)
    optimizer, weight = stepped_optimizer(rule, state_dtype)
    state = optimizer.state[weight]
    assert set(state) - {"step"} == {entry.key for entry in rule.state}
    held = sum(state[entry.key].numel() * state[entry.key].element_size() for entry in rule.state)
    declared = rule.state_bytes_per_parameter(WIDTH, state_dtype) * weight.numel()
    assert held == pytest.approx(declared)
    assert TablePlan.resolve(update=name, state_dtype=state_dtype).state_bytes_per_parameter(WIDTH) == \
        rule.state_bytes_per_parameter(WIDTH, state_dtype)
    for key in rule.row_state_keys:
        assert state[key].shape == (ROWS,) and state[key].dtype == torch.float32
    assert torch.isfinite(weight).all()


@pytest.mark.parametrize("name", TABLE_UPDATES)
def test_every_reader_takes_the_rule_from_its_entry(name, capsys):
    rule = update_rule(name)
    plan = TablePlan.resolve(update=name)
    assert plan.rule is rule and plan.sparse == rule.sparse
    assert plan.in_stores == rule.sparse  # only the table optimizer keeps gradients by row
    assert plan.gradient_bytes_per_parameter() == (0 if rule.sparse else 4)
    assert rule.describe_state("fp32") in TableStorage(update=name).describe_state()
    assert TableStorage(update=name).bytes_per_parameter(WIDTH) == 4 + plan.gradient_bytes_per_parameter() + \
        rule.state_bytes_per_parameter(WIDTH, "fp32")
    from fe_megatron.megatron_lm.arguments import add_factorengram_arguments

    parsed = add_factorengram_arguments(argparse.ArgumentParser()).parse_args(["--fe-table-update", name])
    assert parsed.fe_table_update == name
    from fe_megatron.planning.cli import main as fe_plan

    assert fe_plan(["--preset", "factorengram-tiny", "--dp", "2", "--table-sharding", "rows", "--table-update",
                    name]) == 0
    assert rule.describe_state("fp32") in capsys.readouterr().out


def test_a_change_of_rule_resumes_only_where_the_state_carries_over():
    def info(rule):
        return {"config": {"memory": {"layers": [1]}, "optimizer": {"table_update": rule}}}

    assert compare(info("adamw"), info("lazy_adam"))[0] == []  # the same two moments per parameter
    refused, _ = compare(info("adamw"), info("partial_rowwise_adam"))
    assert refused == ["optimizer.table_update is 'adamw' in the checkpoint and 'partial_rowwise_adam' now; their "
                       "optimizer states differ (exp_avg per parameter and exp_avg_sq per parameter against exp_avg "
                       "per parameter and exp_avg_sq per row), so the tables' optimizer state does not carry over"]
    assert compare(info("rowwise_adagrad"), info("partial_rowwise_adam"))[0]
    assert compare(info("partial_rowwise_adam"), info("partial_rowwise_adam"), weights_only=True)[0] == []


def test_an_unknown_rule_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'sgd' is not one of \('adamw', 'rowwise_adagrad', 'lazy_adam', "
                                         r"'partial_rowwise_adam'\)"):
        update_rule("sgd")
    assert list(RULES) == list(TABLE_UPDATES)


def test_per_row_state_is_checkpointed_under_its_own_key():
    assert [(key, update_rule(name).checkpoint_key(key, True)) for name in TABLE_UPDATES
            for key in update_rule(name).row_state_keys] == [("momentum", "row_momentum"),
                                                            ("exp_avg_sq", "row_exp_avg_sq")]
