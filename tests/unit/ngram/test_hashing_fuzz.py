"""Fuzzing the hasher with hypothesis: ids at the vocabulary bounds hash as the integer definition says,
on every backend, and ids outside the vocabulary are refused naming the value and position."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from fe_megatron import ops
from fe_megatron.config import MemoryConfig
from fe_megatron.ngram.hashing import NgramHasher, branch_layouts
from tests.helpers.configs import split_backbone


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])


def _exact_indices(layout, ids, pad_id):
    """Eq. 1 and 6 in Python integers (no overflow possible): the hash's definition."""
    out = []
    for t in range(len(ids)):
        row = []
        for mult, modulus, offset in zip(layout.multipliers, layout.moduli, layout.offsets):
            mix = 0
            for k, m in enumerate(mult):
                mix ^= (ids[t - k] if t - k >= 0 else pad_id) * m
            row.append(mix % modulus + offset)
        out.append(row)
    return out


@st.composite
def memory_configs(draw):
    vocab = draw(st.one_of(st.integers(2, 300), st.integers(2, 1 << 24)))
    orders = draw(st.sampled_from([[1], [2], [1, 2], [2, 3], [1, 2, 3], [1, 2, 3, 4]]))
    heads = [draw(st.integers(1, 3)) for _ in orders]
    capacity = [vocab + draw(st.integers(0, 50)) if n == 1 else draw(st.integers(8, 1 << 22)) for n in orders]
    branches = sum(heads)
    return MemoryConfig(**split_backbone(dict(
        vocab_size=vocab, hidden_size=16, num_layers=4, ffn_hidden_size=32, ngram_orders=orders,
        heads_per_order=heads, table_capacity=capacity, coeff_width=4 * branches, memory_dim=8,
        layers=draw(st.sampled_from([[0], [1, 3]])), hash_seed=draw(st.integers(0, 2**63 - 1)))))


@FUZZ
@given(config=memory_configs(), data=st.data())
def test_the_hash_matches_its_integer_definition_at_the_vocabulary_bounds(config, data):
    vocab = config.vocab_size
    ids = data.draw(st.lists(st.one_of(st.sampled_from([0, vocab - 1]), st.integers(0, vocab - 1)), min_size=1,
                             max_size=12))
    hasher = NgramHasher(config)
    got = hasher.indices_per_layer(torch.tensor([ids]))
    for layer, layout in branch_layouts(config).items():
        assert got[layer][0].tolist() == _exact_indices(layout, ids, hasher.pad_id)
        for b, (modulus, offset) in enumerate(zip(layout.moduli, layout.offsets)):
            column = got[layer][0, :, b]
            assert bool(((column >= offset) & (column < offset + modulus)).all())
    for backend in ops.available_backends():
        if backend != "triton":  # the interpreter is too slow for fuzzing; tests/unit/ops/test_kernels.py covers it
            with ops.use_backend(backend):
                assert torch.equal(hasher.indices(torch.tensor([ids])), torch.cat(list(got.values()), -1))


@FUZZ
@given(config=memory_configs(), data=st.data())
def test_ids_outside_the_vocabulary_are_refused_naming_the_value_and_position(config, data):
    vocab = config.vocab_size
    bad = data.draw(st.one_of(st.integers(-2**62, -1), st.integers(vocab, 2**62)))
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
    where = data.draw(st.integers(0, len(ids)))
    ids.insert(where, bad)
    with pytest.raises(ValueError, match=rf"token id {bad} at \[batch=0, position={where}\] is outside the "
                                         rf"vocabulary range \[0, {vocab}\)"):
        NgramHasher(config).indices(torch.tensor([ids]))
