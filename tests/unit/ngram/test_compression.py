"""Token compression (`fe_megatron.ngram.compression`): normalization, variants merged, from sentencepiece
and from Hugging Face tokenizers, as transformers reads them."""

import pytest
import torch

from fe_megatron.ngram import NgramHasher, TokenCompression, normalize_token_text
from tests.helpers.configs import small_config


def test_normalization():
    assert normalize_token_text(" The") == "the"
    assert normalize_token_text("Ｃafé") == "cafe"  # NFKC full-width, accent stripped
    assert normalize_token_text("  ") == " " and normalize_token_text("a \t\n b") == "a b"


def test_compression_from_texts_merges_variants():
    comp = TokenCompression.from_token_texts([None, " The", "the", "THE", "café", "cafe", None, "x"])
    lookup = comp.lookup.tolist()
    assert lookup[1] == lookup[2] == lookup[3] and lookup[4] == lookup[5]
    assert lookup[0] != lookup[6]  # special tokens stay distinct
    assert comp.num_compressed == 5 and max(lookup) == 4


def test_compression_from_sentencepiece_drives_hashing(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(["The cat sat on the mat.", "THE CAT SAT.", "Café au lait, cafe noir."] * 50))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   model_type="bpe", byte_fallback=False, minloglevel=2)
    model = str(tmp_path / "sp.model")
    comp = TokenCompression.from_sentencepiece(model)
    assert comp.vocab_size == 60 and comp.num_compressed < 60
    config = small_config(vocab_size=60, table_capacity=[60, 211, 307], token_compression=model)
    sp = spm.SentencePieceProcessor(model_file=model)
    upper = torch.tensor([sp.encode("THE CAT")])
    lower = torch.tensor([sp.encode("the cat")])
    hasher = NgramHasher(config, 1)
    if upper.shape == lower.shape:
        same = torch.equal(comp.lookup[upper], comp.lookup[lower])
        assert torch.equal(hasher.indices(upper), hasher.indices(lower)) == same
    with pytest.raises(ValueError, match="has 60 ids but MemoryConfig.vocab_size=97"):
        NgramHasher(small_config(token_compression=model), 1)


def test_compression_from_hf_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "The": 1, "the": 2, "Dog": 3, "dog": 4, "dög": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    lookup = TokenCompression.from_hf_tokenizer(hf).lookup.tolist()
    assert lookup[1] == lookup[2] and lookup[3] == lookup[4] == lookup[5] and lookup[0] not in lookup[1:]


def test_compression_of_a_tokenizer_directory_equals_transformers(tmp_path):
    """The core reads a tokenizer directory without transformers; it must compress as AutoTokenizer does."""
    spm = pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers")
    from fe_megatron.ngram.compression import _load

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(["The cat sat on the mat.", "THE CAT SAT, didn't it?", "Café au lait, cafe noir!",
                                 "It's what we've done; they're here."] * 40))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=390,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    directory = tmp_path / "hf"
    transformers.LlamaTokenizer(vocab_file=str(tmp_path / "sp.model")).save_pretrained(directory)
    for clean_up in (False, True):
        hf = transformers.AutoTokenizer.from_pretrained(directory, clean_up_tokenization_spaces=clean_up)
        hf.save_pretrained(directory)
        _load.cache_clear()
        ours = _load(str(directory))
        theirs = TokenCompression.from_hf_tokenizer(transformers.AutoTokenizer.from_pretrained(directory))
        assert ours.lookup.tolist() == theirs.lookup.tolist() and ours.num_compressed == theirs.num_compressed
