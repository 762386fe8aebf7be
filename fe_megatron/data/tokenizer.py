"""Tokenizers with the attributes megatron.core's datasets read (``vocab_size``, ``eod``, ``pad``):
a sentencepiece ``.model`` file (`SentencePieceTokenizer`, what fe-data trains) or a Hugging Face
tokenizer directory (`HFTokenizer`, e.g. a pretrained model's, for continued pretraining after a
graft).  `load_tokenizer` picks by path.  megatron.core renames its tokenizer base class between
releases and only duck-types it, so these are plain classes."""

from __future__ import annotations

import os

import numpy


class SentencePieceTokenizer:
    """Wraps a sentencepiece model; the end-of-document token is the model's ``</s>``."""

    def __init__(self, model_file: str):
        import sentencepiece as spm

        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"tokenizer model {model_file!r} does not exist")
        self.model_file = model_file
        self.sp = spm.SentencePieceProcessor(model_file=model_file)
        if self.sp.eos_id() < 0:
            raise ValueError(f"tokenizer {model_file!r} has no end-of-sentence piece to mark document ends")

    @property
    def unique_identifiers(self) -> dict:
        """What megatron's dataset cache keys on."""
        return {"class": type(self).__name__, "tokenizer_path": [os.path.abspath(self.model_file)]}

    def tokenize(self, text: str) -> numpy.ndarray:
        return numpy.asarray(self.sp.encode(text), dtype=numpy.int64)

    def detokenize(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    @property
    def vocab(self):
        return {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self):
        return {i: self.sp.id_to_piece(i) for i in range(self.vocab_size)}

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self.sp.eos_id()

    @property
    def pad(self) -> int:
        return self.sp.pad_id() if self.sp.pad_id() >= 0 else -1

    @property
    def bos(self) -> int:
        return self.sp.bos_id()


class HFTokenizer:
    """A Hugging Face tokenizer directory (``tokenizer.json`` or ``tokenizer_config.json``); the
    end-of-document token is its ``eos_token``."""

    def __init__(self, directory: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(f"tokenizer {directory!r} is a Hugging Face tokenizer directory, which needs "
                              "transformers: pip install -e '.[hf]'") from None
        self.model_file = directory
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {directory!r} has no eos_token to mark document ends")

    @property
    def unique_identifiers(self) -> dict:
        return {"class": type(self).__name__, "tokenizer_path": [os.path.abspath(self.model_file)]}

    def tokenize(self, text: str) -> numpy.ndarray:
        return numpy.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=numpy.int64)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    @property
    def vocab(self):
        return self.tokenizer.get_vocab()

    @property
    def inv_vocab(self):
        return {i: piece for piece, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eod(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad(self) -> int:
        """-1 (none) when the tokenizer has no pad token of its own: many pretrained tokenizers reuse
        their end-of-text token, and fe-pretrain's documents are never padded."""
        pad = self.tokenizer.pad_token_id
        return -1 if pad is None or pad in (self.tokenizer.eos_token_id, self.tokenizer.bos_token_id) else pad

    @property
    def bos(self) -> int:
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else -1


def load_tokenizer(path: str):
    """`HFTokenizer` for a directory, `SentencePieceTokenizer` for a ``.model`` file."""
    if os.path.isdir(path):
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)


def tokenizer_file(path: str) -> str:
    """The file that defines a tokenizer (what a checkpoint's checksum covers): the ``.model`` file,
    or a directory's ``tokenizer.json`` (its ``tokenizer_config.json`` when there is none)."""
    if not os.path.isdir(path):
        return path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise FileNotFoundError(f"tokenizer directory {path!r} has no tokenizer.json or tokenizer_config.json")


def train_sentencepiece(text_iter, model_prefix: str, vocab_size: int = 32000, model_type: str = "bpe") -> str:
    """Train a BPE sentencepiece model (digits split, byte fallback, ``<pad>`` = 3), as for the paper's 32K
    vocabulary. Returns the ``.model`` path."""
    import sentencepiece as spm

    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=text_iter, model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
        byte_fallback=True, split_digits=True, pad_id=3, unk_id=0, bos_id=1, eos_id=2,
        input_sentence_size=2_000_000, shuffle_input_sentence=True, max_sentence_length=16384,
        minloglevel=2, num_threads=os.cpu_count() or 1)
    return model_prefix + ".model"
