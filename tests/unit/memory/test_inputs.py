"""The one lookup protocol (``start_lookup(addresses) -> handle``, ``handle.rows()``) for every kind of table,
and the one scheduler of lookups (`fe_megatron.memory.inputs`), on fresh random tables and ids."""

import copy

import pytest
import torch

from fe_megatron.memory import FactorEngram
from fe_megatron.memory.inputs import MemoryInputs, schedule_lookups, start_lookups
from fe_megatron.tables.holders import ModuleLookup
from fe_megatron.tables.store import StartedLookup, StoreLookup
from tests.helpers.configs import small_config
from tests.helpers.memory import randomize


def branch_and_ids(layer=1, **overrides):
    torch.manual_seed(7)
    cfg = small_config(**overrides)
    branch = randomize(FactorEngram(cfg, layer))
    return branch, torch.randint(0, cfg.vocab_size, (2, 9))


@pytest.mark.parametrize("placement", ["parameter", "device", "host"])
def test_every_kind_of_table_answers_the_same_protocol_with_the_same_rows(placement):
    branch, ids = branch_and_ids()
    addresses = branch.addresses(ids)
    expected = branch.tables.weight.detach()[addresses]  # [b, s, branches, width]
    if placement != "parameter":
        branch.tables.manage(placement)
    lookup = branch.start_lookup(addresses)
    assert isinstance(lookup, StartedLookup)
    assert isinstance(lookup, ModuleLookup if placement == "parameter" else StoreLookup)
    assert torch.equal(lookup.indices, addresses)
    torch.testing.assert_close(lookup.rows().detach(), expected, rtol=0, atol=0)


def test_a_table_lookup_reads_again_and_its_gradient_reaches_the_table():
    branch, ids = branch_and_ids()
    lookup = branch.start_lookup(branch.addresses(ids))
    weight = torch.randn(lookup.rows().shape)
    (lookup.rows() * weight).sum().backward()
    first = branch.tables.weight.grad.clone()
    branch.tables.weight.grad = None
    (lookup.rows() * weight).sum().backward()  # a second read (a recomputation) gathers again
    torch.testing.assert_close(branch.tables.weight.grad, first, rtol=0, atol=0)
    expected = torch.zeros_like(first).index_put_((lookup.indices.reshape(-1),), weight.flatten(0, -2),
                                                  accumulate=True)
    torch.testing.assert_close(first, expected)


def test_started_now_at_each_run_or_ahead_the_branch_gives_the_same_output_and_gradients():
    reference, ids = branch_and_ids()
    h = torch.randn(2, 9, reference.config.hidden_size)
    out_weight = torch.randn(2, 9, reference.config.output_size)

    def run(branch, inputs):
        m, l1 = branch(h, lookup=inputs.lookup_of(1, branch))
        ((m * out_weight).sum() + l1.sum()).backward()
        return m.detach(), {name: p.grad.clone() for name, p in branch.named_parameters()}

    results = []
    for schedule in ("now", "at each run", "ahead"):
        branch = copy.deepcopy(reference)
        branches, addresses = {1: branch}, {1: branch.addresses(ids)}
        given = MemoryInputs(lookups=start_lookups(branches, addresses)) if schedule == "ahead" \
            else MemoryInputs(addresses=addresses)
        inputs = schedule_lookups(branches, given, recomputed=False, start_now=schedule == "now")
        assert (1 in inputs.addresses) == (schedule == "at each run")
        assert (1 in inputs.lookups) == (schedule != "at each run")
        results.append(run(branch, inputs))
    for m, grads in results[1:]:
        torch.testing.assert_close(m, results[0][0], rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, results[0][1][name], rtol=0, atol=0, msg=name)


def test_a_host_tier_lookup_read_twice_says_why():
    branch, ids = branch_and_ids()
    branch.tables.manage("host")
    lookup = branch.start_lookup(branch.addresses(ids))
    lookup.rows()
    with pytest.raises(RuntimeError, match="read already; a started lookup is read once"):
        lookup.rows()


def test_a_recomputed_forward_keeps_the_addresses_and_refuses_lookups_started_ahead():
    branch, ids = branch_and_ids()
    branches, addresses = {1: branch}, {1: branch.addresses(ids)}
    inputs = schedule_lookups(branches, MemoryInputs(addresses=addresses), recomputed=True)
    assert inputs.addresses_of(1) is addresses[1] and not inputs.lookups
    first, second = inputs.lookup_of(1, branch), inputs.lookup_of(1, branch)  # each run starts its own
    assert first is not second and torch.equal(first.rows(), second.rows())
    with pytest.raises(ValueError, match=r"memory layers \[1\]: where a forward is recomputed"):
        schedule_lookups(branches, MemoryInputs(lookups=start_lookups(branches, addresses)), recomputed=True)


def test_missing_layers_and_foreign_entries_are_refused_by_name():
    branch, ids = branch_and_ids()
    addresses = branch.addresses(ids)
    with pytest.raises(ValueError, match=r"no entry for memory layers \[1\] \(they have \[3\]\)"):
        schedule_lookups({1: branch}, MemoryInputs(addresses={3: addresses}), recomputed=False)
    with pytest.raises(RuntimeError, match=r"no memory inputs for memory layer 4 in this forward \(it has \[1\]\)"):
        MemoryInputs(addresses={1: addresses}).lookup_of(4, branch)
    with pytest.raises(TypeError, match="memory layer 1: addresses are a tensor of row indices, got a list"):
        MemoryInputs(addresses={1: [1, 2]})
    with pytest.raises(TypeError, match=r"memory layer 1: a started lookup \(branch.start_lookup\(addresses\)\), got a "
                                        "Tensor"):
        MemoryInputs(lookups={1: addresses})
    lookup = branch.start_lookup(addresses)
    with pytest.raises(ValueError, match=r"memory layers \[1\] have both addresses and a started lookup"):
        MemoryInputs(addresses={1: addresses}, lookups={1: lookup})


def test_the_dict_the_model_files_of_2026_11_28_schedule_still_works():
    """Converted folders keep the model file fe-convert wrote; those of 2026-11-28 schedule a dict of addresses
    and started lookups, with their decodings: still scheduled alike, with a deprecation warning."""
    branch, ids = branch_and_ids()
    branches, addresses = {1: branch}, {1: branch.addresses(ids)}
    with pytest.warns(DeprecationWarning, match="a dict of addresses and started lookups is deprecated"):
        inputs = schedule_lookups(branches, addresses, recomputed=True, decodings={})
    assert inputs.addresses_of(1) is addresses[1]
    with pytest.warns(DeprecationWarning):
        inputs = schedule_lookups(branches, start_lookups(branches, addresses), recomputed=False, start_now=False)
    assert sorted(inputs.lookups) == [1] and not inputs.addresses
