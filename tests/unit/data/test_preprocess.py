"""`fe_megatron.data.preprocess`: the indexed dataset holds the tokenizer's ids of every document."""

import numpy

from fe_megatron.data.sources import iter_documents


def test_preprocess_roundtrip(small_data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from fe_megatron.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(small_data["tokenizer"])
    dataset = IndexedDataset(small_data["prefix"])
    assert len(dataset) == 40
    first_text = next(iter_documents([small_data["subset"]]))
    first = numpy.asarray(dataset[0])
    assert first[-1] == tok.eod and first[:-1].tolist() == tok.tokenize(first_text).tolist()
    assert tok.detokenize(first[:50]) in first_text
