"""Optional token compression: merge token ids whose surface text normalizes equally.

As in DeepSeek's Engram, each token's text is normalized (NFKC, accent stripping,
lowercasing, whitespace runs collapsed to one space, then stripped unless the token is
pure whitespace), and tokens with equal normalized text share one compressed id.  The
n-gram addresses are computed on compressed ids, so " The", "the" and "THE" share
memory rows.  Control, unknown and byte-fallback pieces keep distinct ids.

The normalization is written with Python's ``unicodedata`` instead of the Hugging Face
``tokenizers`` normalizers so that it needs no extra dependency and gives the same map
for sentencepiece and Hugging Face tokenizers.
"""

from __future__ import annotations

import functools
import os
import re
import unicodedata
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

_WHITESPACE = re.compile(r"[ \t\r\n]+")


def normalize_token_text(text: str) -> str:
    """NFKC -> NFD -> strip accents -> lowercase -> collapse whitespace -> strip."""
    text = unicodedata.normalize("NFKC", text)
    text = unicodedata.normalize("NFD", text)
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
    text = _WHITESPACE.sub(" ", text.lower())
    return text if text == " " else text.strip()


@dataclass
class TokenCompression:
    """``lookup[token_id]`` -> compressed id in ``[0, num_compressed)``."""

    lookup: torch.Tensor  # int64 [vocab_size]
    num_compressed: int

    @property
    def vocab_size(self) -> int:
        return int(self.lookup.numel())

    @classmethod
    def from_token_texts(cls, texts: Iterable[Optional[str]]) -> "TokenCompression":
        """``texts[i]`` is token i's surface text, or None for a token that must keep its own id."""
        key_to_new, lookup = {}, []
        for token_id, text in enumerate(texts):
            key = ("raw", token_id) if text is None else ("text", normalize_token_text(text) or text)
            lookup.append(key_to_new.setdefault(key, len(key_to_new)))
        return cls(torch.tensor(lookup, dtype=torch.int64), len(key_to_new))

    @classmethod
    def from_sentencepiece(cls, model_file: str) -> "TokenCompression":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(model_file))
        texts = []
        for i in range(sp.get_piece_size()):
            special = sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i)
            texts.append(None if special else sp.id_to_piece(i).replace("\u2581", " "))
        return cls.from_token_texts(texts)

    @classmethod
    def from_hf_tokenizer(cls, tokenizer) -> "TokenCompression":
        """From a Hugging Face tokenizer object (special tokens and undecodable pieces stay distinct)."""
        special = set(getattr(tokenizer, "all_special_ids", []))
        texts = []
        for i in range(len(tokenizer)):
            text = tokenizer.decode([i], skip_special_tokens=False)
            texts.append(None if i in special or "\ufffd" in text else text)
        return cls.from_token_texts(texts)


class _TokenizerFile:
    """A Hugging Face tokenizer directory read with the ``tokenizers`` library alone, as much of
    it as `TokenCompression.from_hf_tokenizer` uses: its length, its special ids and the decoding
    of one id (with transformers' ``clean_up_tokenization_spaces`` rule).  The core does not import
    transformers; ``tests/unit/ngram/test_compression.py`` checks this against ``AutoTokenizer``."""

    _CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # transformers' clean_up_tokenization

    def __init__(self, directory: str):
        import json

        from tokenizers import Tokenizer

        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"MemoryConfig.token_compression: {directory!r} has no tokenizer.json (a fast "
                                    "Hugging Face tokenizer directory is expected)")
        self.tokenizer = Tokenizer.from_file(path)
        settings = {}
        if os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
            with open(os.path.join(directory, "tokenizer_config.json")) as fh:
                settings = json.load(fh)
        self.clean_up = bool(settings.get("clean_up_tokenization_spaces", False))
        special = {token.content for token in self.tokenizer.get_added_tokens_decoder().values() if token.special}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
            value = settings.get(key)
            special.add(value.get("content") if isinstance(value, dict) else value)
        self.all_special_ids = {self.tokenizer.token_to_id(text) for text in special if text} - {None}

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: list, skip_special_tokens: bool = False) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up:
            for before, after in self._CLEANUPS:
                text = text.replace(before, after)
        return text


@functools.lru_cache(maxsize=8)
def _load(path: str) -> TokenCompression:
    if os.path.isdir(path):
        return TokenCompression.from_hf_tokenizer(_TokenizerFile(path))
    if os.path.isfile(path):
        return TokenCompression.from_sentencepiece(path)
    raise FileNotFoundError(f"MemoryConfig.token_compression: {path!r} is neither a sentencepiece model file "
                            "nor a Hugging Face tokenizer directory")


def load_token_compression(path: str, vocab_size: int) -> TokenCompression:
    """Load (once per process) and check that the tokenizer matches ``vocab_size``."""
    compression = _load(str(path))
    if compression.vocab_size != vocab_size:
        raise ValueError(f"MemoryConfig.token_compression: tokenizer {path!r} has {compression.vocab_size} ids "
                         f"but MemoryConfig.vocab_size={vocab_size}")
    return compression
