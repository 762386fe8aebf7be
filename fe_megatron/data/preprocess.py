"""Tokenize documents into a Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``)."""

from __future__ import annotations

import os
import time
from typing import List

import numpy
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

from fe_megatron.data.sources import DataError, iter_documents, validate_inputs
from fe_megatron.data.tokenizer import load_tokenizer


def preprocess(inputs: List[str], tokenizer_model: str, output_prefix: str, text_key: str = "text",
               hf_split: str = "train", max_documents: int = None, progress: bool = True) -> dict:
    """Each document becomes its tokens followed by the end-of-document token.

    Writes to temporary files and renames them at the end, so an interrupted run never
    leaves a half-written dataset under ``output_prefix``. Returns the counts.
    """
    tokenizer = load_tokenizer(tokenizer_model)
    expected = validate_inputs(inputs, text_key)
    dtype = numpy.uint16 if tokenizer.vocab_size < 65500 else numpy.int32
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp_prefix = output_prefix + ".tmp"
    builder = IndexedDatasetBuilder(get_bin_path(tmp_prefix), dtype=dtype)
    bar = _progress(expected if not any(s.startswith("hf:") for s in inputs) else max_documents, progress)
    start, documents, tokens = time.time(), 0, 0
    try:
        for text in iter_documents(inputs, text_key, hf_split):
            ids = tokenizer.tokenize(text).tolist() + [tokenizer.eod]
            builder.add_document(torch.tensor(ids), [len(ids)])
            documents += 1
            tokens += len(ids)
            bar.update(1)
            bar.set_postfix_str(f"{tokens / max(time.time() - start, 1e-9):,.0f} tokens/s", refresh=False)
            if max_documents is not None and documents >= max_documents:
                break
        if documents == 0:
            raise DataError(f"empty corpus: no documents in {', '.join(inputs)}")
        builder.finalize(get_idx_path(tmp_prefix))
    except BaseException:  # bad input, an interrupted stream, Ctrl-C: leave nothing behind
        builder.data_file.close()
        for path in (get_bin_path(tmp_prefix), get_idx_path(tmp_prefix)):
            if os.path.exists(path):
                os.remove(path)
        raise
    finally:
        bar.close()
    os.replace(get_bin_path(tmp_prefix), get_bin_path(output_prefix))
    os.replace(get_idx_path(tmp_prefix), get_idx_path(output_prefix))
    elapsed = max(time.time() - start, 1e-9)
    return dict(documents=documents, tokens=tokens, seconds=round(elapsed, 2),
                tokens_per_second=round(tokens / elapsed), output_prefix=output_prefix)


def _progress(total, enabled):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="doc", disable=not enabled, mininterval=1.0)
    except ImportError:
        class _Null:
            def update(self, n):
                pass

            def set_postfix_str(self, text, refresh=True):
                pass

            def close(self):
                pass

        return _Null()
