"""Fuzzing the data pipeline and the hasher with hypothesis: arbitrary Unicode, empty and huge
documents, arbitrary bytes, ids at the vocabulary bounds.  Everything either works, exactly,
or fails with a DataError / ValueError that names the problem."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fe_megatron import ops
from fe_megatron.config import MemoryConfig
from fe_megatron.data.preprocess import preprocess
from fe_megatron.data.sources import DataError, iter_documents
from fe_megatron.data.tokenizer import SentencePieceTokenizer
from fe_megatron.ngram.hashing import NgramHasher, branch_layouts
from tests.helpers.configs import split_backbone

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])
# every code point, lone surrogates included (JSON can carry them as \ud800 escapes)
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=200)


def read_back(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


@FUZZ
@given(texts=st.lists(ANY_TEXT, max_size=8))
def test_any_unicode_jsonl_is_tokenized_exactly_or_refused_naming_the_line(small_data, tmp_path_factory, texts):
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = SentencePieceTokenizer(small_data["tokenizer"])
    invalid = [i for i, t in enumerate(texts) if not _is_valid_unicode(t)]
    kept = [t for t in texts if t.strip()]
    try:
        result = preprocess([str(path)], small_data["tokenizer"], str(folder / "out"), progress=False)
    except DataError as err:
        if invalid:
            assert f"{path}:{invalid[0] + 1}: field 'text' holds an unpaired surrogate" in str(err)
        else:
            assert not kept and "empty corpus: no documents" in str(err)
        assert not list(folder.glob("out*")), "a refused input must leave nothing behind"
        return
    assert not invalid
    expected = [tokenizer.tokenize(t).tolist() + [tokenizer.eod] for t in kept]
    assert result["documents"] == len(kept) and read_back(str(folder / "out")) == expected
    assert all(0 <= i < tokenizer.vocab_size for doc in expected for i in doc)


def _is_valid_unicode(text):
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@FUZZ
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".txt", ".jsonl"]))
def test_arbitrary_bytes_are_read_or_refused_with_a_data_error(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("bytes") / f"input{suffix}"
    path.write_bytes(data)
    try:
        documents = list(iter_documents([str(path)]))
    except DataError as err:
        assert str(err).startswith(f"{path}:")
        return
    assert all(isinstance(d, str) and d.strip() for d in documents)


def test_a_huge_document_and_empty_ones_around_it(small_data, tmp_path):
    huge = " ".join(f"word{i % 997} ünïcödé 漢字 🙂" for i in range(60_000))  # ~1.5 M characters
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["", huge, "   ", "\n", "a"]))
    result = preprocess([str(path)], small_data["tokenizer"], str(tmp_path / "out"), progress=False)
    tokenizer = SentencePieceTokenizer(small_data["tokenizer"])
    docs = read_back(str(tmp_path / "out"))
    assert result["documents"] == 2 and docs[0] == tokenizer.tokenize(huge).tolist() + [tokenizer.eod]
    assert len(docs[0]) > 100_000 and docs[1] == tokenizer.tokenize("a").tolist() + [tokenizer.eod]


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
        if backend != "triton":  # the interpreter is too slow for fuzzing; tests/test_kernels.py covers it
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
