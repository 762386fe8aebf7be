"""Data: sources, tokenizer, preprocessing, datasets."""

from fe_megatron.data.sources import DataError

__all__ = ["DataError"]
