"""The n-gram hash (`fe_megatron.ngram.hashing`, Eq. 1-5): its reference vectors, golden outputs, a
token-by-token Python reference, layouts and multipliers, padding, and bad token ids."""

import pytest
import torch

from fe_megatron.config import MemoryConfig
from fe_megatron.ngram import NgramHasher, branch_layouts
from fe_megatron.ngram.hashing import _is_prime, _splitmix64, layer_multipliers
from tests.helpers.configs import small_config
from tests.helpers.hashing import GOLDEN_CONFIG, GOLDEN_IDS, GOLDEN_INDICES, python_reference_indices


def test_splitmix64_reference_vector():
    state, outs = 0, []
    for _ in range(3):
        state, z = _splitmix64(state)
        outs.append(z)
    assert outs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_golden_vectors():
    config = MemoryConfig(**GOLDEN_CONFIG)
    layouts = branch_layouts(config)
    assert layouts[0].moduli == (1000, 1000, 5003, 5009, 7001, 7013)
    assert layouts[2].moduli == (1000, 1000, 5011, 5021, 7019, 7027)
    assert layouts[0].multipliers[-1] == (2080322831400627, 2591141709272583, 4781461867510717)
    got = NgramHasher(config).indices(torch.tensor(GOLDEN_IDS))
    assert got.dtype == torch.int64 and got.tolist() == GOLDEN_INDICES
    assert NgramHasher(config).indices(torch.tensor(GOLDEN_IDS, dtype=torch.int32)).tolist() == GOLDEN_INDICES


@pytest.mark.parametrize("vocab", [97, 32000, 1 << 20])
def test_vectorized_hash_equals_python_reference(vocab):
    config = small_config(vocab_size=vocab, table_capacity=[vocab, 211, 307])
    ids = torch.randint(0, vocab, (3, 29))
    ids[0, :4] = vocab - 1  # the largest ids, where overflow would show
    for layer in config.layers:
        got = NgramHasher(config, layer).indices(ids)
        assert got.tolist() == python_reference_indices(config, layer, ids.tolist())


def test_layout_primes_offsets_and_ranges():
    config = small_config()
    all_primes = []
    for layer, lay in branch_layouts(config).items():
        for n, mod, cap in zip(lay.orders, lay.moduli, [97, 97, 211, 211, 307, 307]):
            if n == 1:
                assert mod == cap
            else:
                assert mod >= cap and _is_prime(mod)
                all_primes.append(mod)
        assert list(lay.offsets) == [sum(lay.moduli[:i]) for i in range(len(lay.moduli))]
        idx = NgramHasher(config, layer).indices(torch.randint(0, 97, (4, 50)))
        for b, (off, mod) in enumerate(zip(lay.offsets, lay.moduli)):
            assert idx[..., b].min() >= off and idx[..., b].max() < off + mod
    assert len(all_primes) == len(set(all_primes))  # distinct across heads, orders and layers


def test_multipliers_are_odd_and_layer_specific():
    a = layer_multipliers(0, 10, 3, 32000)
    b = layer_multipliers(0, 12, 3, 32000)
    assert all(m % 2 == 1 and m * 32000 < 2 ** 63 for m in a + b) and a != b
    assert layer_multipliers(1, 10, 3, 32000) != a


def test_pad_before_sequence_start_and_shift_consistency():
    config = small_config()
    hasher = NgramHasher(config, 1)
    ids = torch.randint(0, 97, (1, 20))
    full = hasher.indices(ids)
    # the trigram at position 5 depends only on tokens 3..5
    window = hasher.indices(ids[:, 3:6])
    assert torch.equal(full[0, 5], window[0, 2])
    # at position 0 the bigram/trigram see the pad id, so they differ from a real left context
    with_left = hasher.indices(torch.cat([torch.tensor([[0]]), ids], 1))
    assert not torch.equal(full[0, 0, 2:], with_left[0, 1, 2:])
    assert torch.equal(full[0, 0, :2], with_left[0, 1, :2])  # unigrams see no context


def test_all_layers_in_one_call_equal_per_layer_hashers():
    config = small_config()
    ids = torch.randint(0, 97, (2, 33))
    per_layer = NgramHasher(config).indices_per_layer(ids)
    for layer in config.layers:
        assert torch.equal(per_layer[layer], NgramHasher(config, layer).indices(ids))


@pytest.mark.parametrize("ids, error, fragment", [
    (torch.tensor([[1, 2, 97]]), ValueError, r"token id 97 at \[batch=0, position=2\] is outside the vocabulary range \[0, 97\)"),
    (torch.tensor([[1, -3, 2]]), ValueError, r"token id -3 at \[batch=0, position=1\]"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "must be an integer tensor"),
    (torch.tensor([1, 2, 3]), ValueError, r"must have shape \[batch, seq\], got shape \(3,\)"),
    ([[1, 2]], TypeError, "must be a torch.Tensor"),
])
def test_bad_token_ids(ids, error, fragment):
    with pytest.raises(error, match=fragment):
        NgramHasher(small_config(), 1).indices(ids)


def test_layer_subset_is_one_launch_equal_to_the_full_hash():
    config = small_config(layers=[0, 1, 3])
    ids = torch.randint(0, config.vocab_size, (2, 40))
    full = NgramHasher(config).indices_per_layer(ids)
    subset = NgramHasher(config, [3, 0]).indices_per_layer(ids)
    assert list(subset) == [3, 0]
    for layer in (3, 0):
        assert torch.equal(subset[layer], full[layer])
    with pytest.raises(ValueError, match="no layers to hash"):
        NgramHasher(config, [])


def test_unknown_layer_rejected():
    with pytest.raises(ValueError, match=r"layer index 2 is not an insertion layer; config.layers=\[1, 3\]"):
        NgramHasher(small_config(), 2)
    with pytest.raises(ValueError, match=r"layer index 2 is not an insertion layer"):
        NgramHasher(small_config(), [1, 2])


def packed_documents(seed: int, lengths=(5, 1, 7, 3, 2), vocab: int = 97):
    """``(ids [2, n], position_ids [2, n], documents)``: the documents laid end to end in each row (the second
    row in the reverse order), with position ids that restart at 0 where each begins."""
    generator = torch.Generator().manual_seed(seed)
    documents = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
    rows = [documents, documents[::-1]]
    ids = torch.stack([torch.cat(row) for row in rows])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in rows])
    return ids, positions, rows


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_with_position_ids_no_ngram_spans_two_documents(compiled):
    """Documents packed into one sequence, their position ids restarting at 0: each position's addresses are those
    of its document hashed alone (nothing before its first token), eagerly and inside a compiled graph (which
    re-hashes every window rather than count the crossing ones); position ids counting up change nothing."""
    cfg = small_config()
    hasher = NgramHasher(cfg)
    ids, positions, rows = packed_documents(3)
    def hash_within(token_ids, position_ids):
        return hasher.indices(token_ids, False, position_ids)

    if compiled:
        hash_within = torch.compile(hash_within, backend="aot_eager", fullgraph=True)
    alone = torch.stack([torch.cat([hasher.indices(d.unsqueeze(0))[0] for d in row]) for row in rows])
    assert torch.equal(hash_within(ids, positions), alone)
    assert not torch.equal(hasher.indices(ids), alone)  # without them, the trigrams after each start differ
    counting = torch.arange(ids.shape[1]).unsqueeze(0)
    assert torch.equal(hash_within(ids, counting), hasher.indices(ids))


def test_a_decoder_s_look_back_stops_at_a_document_s_start():
    """An incremental decoder's ids start with its look-back; the new positions' ids restart a document."""
    cfg = small_config()
    hasher = NgramHasher(cfg, cfg.layers[0])
    ids, positions, _ = packed_documents(5)
    history = cfg.max_order - 1
    whole = hasher.indices(ids, position_ids=positions)
    for start in range(history, ids.shape[1]):  # the same positions, hashed after `history` ids of look-back
        window = ids[:, start - history:start + 1]
        assert torch.equal(hasher.indices_of_lookup_ids(window, positions[:, start:start + 1])[:, -1],
                           whole[:, start])
