"""A sentencepiece tokenizer with the attributes megatron.core's datasets read (``vocab_size``,
``eod``, ``pad``), and training one. megatron.core renames its tokenizer base class between
releases and only duck-types it, so this is a plain class."""

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
