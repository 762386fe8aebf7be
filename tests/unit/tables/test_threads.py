"""The tables' thread count on host CPUs (`fe_megatron.tables.threads`): chosen by measured time, and
changing no bit of a step."""

import pytest
import torch

from fe_megatron.tables import threads
from fe_megatron.tables.store import StoreLookup, TableStore
from fe_megatron.tables.update_rules import update_rule
from fe_megatron.training.config import OptimizerArgs


def test_small_work_runs_on_one_thread_and_large_work_on_the_faster_count():
    choice = threads.ThreadChoice("test")
    assert choice.choose(threads.SMALL_WORK - 1, available=4) == 1
    large = threads.SMALL_WORK
    assert choice.choose(large, available=4) == 1  # untried counts first
    choice.record(1, large, 2.0)
    assert choice.choose(large, available=4) == 4
    choice.record(4, large, 1.0)
    picks = []
    for _ in range(20 * threads.FIRST_PROBE):  # the faster count, and probes of the other ever further apart
        picks.append(choice.choose(large, 4))
        choice.record(picks[-1], large, 1.0 if picks[-1] == 4 else 2.0)
    probes = [run for run, picked in enumerate(picks) if picked == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]
    assert len(probes) < len(picks) / 16
    for _ in range(4 * threads.LAST_PROBE):  # the host got busy: 4 threads now take longer than 1
        picked = choice.choose(large, 4)
        choice.record(picked, large, 5.0 if picked == 4 else 2.0)
    assert choice.best == 1
    assert choice.choose(large, available=1) == 1


def table_step(rule_name: str, thread_count: int) -> torch.Tensor:
    """One lookup, backward and update of a store on the host, at ``thread_count`` threads."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(60_000, 64, generator=gen)
    ids = torch.randint(0, 60_000, (40_000,), generator=gen)
    grad = torch.randn(40_000, 64, generator=gen)
    store = TableStore(weight, "device")
    rule = update_rule(rule_name)
    if rule.sparse:
        store.allocate_row_gradients()
    else:
        store.allocate_gradient(torch.float32)
    optimizer = rule.build([store], OptimizerArgs(lr=1e-2, weight_decay=0.1), "fp32", seed=0)
    previous = torch.get_num_threads()
    torch.set_num_threads(thread_count)
    try:
        for _ in range(2):
            StoreLookup(store, ids, torch.device("cpu")).rows().backward(grad)
            optimizer.step()
            if rule.sparse:
                store.row_gradients.clear()
            else:
                store.main_grad.zero_()
    finally:
        torch.set_num_threads(previous)
    return store.weight


@pytest.mark.parametrize("rule", ["adamw", "rowwise_adagrad", "partial_rowwise_adam"])
def test_the_thread_count_changes_no_bit_of_a_table_step(rule, monkeypatch):
    monkeypatch.setattr(threads.ThreadChoice, "choose", lambda self, elements, available: available)  # as set
    assert torch.equal(table_step(rule, 1), table_step(rule, 2))
