"""Fuzzing the data pipeline with hypothesis: arbitrary Unicode, empty and huge documents, arbitrary
bytes.  Everything either works, exactly, or fails with a DataError that names the problem."""

import json

from hypothesis import HealthCheck, given, settings, strategies as st

from fe_megatron.data.preprocess import preprocess
from fe_megatron.data.sources import DataError, iter_documents
from fe_megatron.data.tokenizer import SentencePieceTokenizer


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
