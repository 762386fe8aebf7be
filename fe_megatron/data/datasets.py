"""Train/valid/test GPT datasets through megatron.core's BlendedMegatronDatasetBuilder, and
the deterministic batches each data-parallel rank reads at a given iteration."""

from __future__ import annotations

import os
from typing import List

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

from fe_megatron.data.sources import DataError


def parse_blend(train_data: List):
    """``[prefix]`` or ``[weight, prefix, weight, prefix, ...]`` -> (prefixes, weights or None)."""
    if len(train_data) == 1:
        return [str(train_data[0])], None
    if len(train_data) % 2:
        raise DataError(f"data.train_data {train_data} must be one prefix or weight/prefix pairs")
    weights = [float(w) for w in train_data[0::2]]
    prefixes = [str(p) for p in train_data[1::2]]
    return prefixes, weights


def build_datasets(train_data: List, tokenizer, seq_length: int, split: str, sizes: List[int], seed: int,
                   cache_dir: str = None, reset_position_ids: bool = False, reset_attention_mask: bool = False):
    """megatron.core's GPT datasets of the blend; with ``reset_position_ids`` / ``reset_attention_mask`` (Megatron-LM's
    flags of the same names) the documents packed into a sample restart their positions after each end-of-document
    token / attend only within themselves (each sample then carries its own attention mask)."""
    prefixes, weights = parse_blend(train_data)
    missing = missing_dataset_files(prefixes)
    if missing:
        raise DataError(f"data.train_data: {missing[0][1]} does not exist; create it with fe-data preprocess")
    every_split_problems(prefixes, split, sizes)
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=(prefixes, weights), split=split,
                              tokenizer=tokenizer, reset_position_ids=reset_position_ids,
                              reset_attention_mask=reset_attention_mask, eod_mask_loss=False,
                              create_attention_mask=reset_attention_mask, path_to_cache=cache_dir,
                              mid_level_dataset_surplus=0.005)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def missing_dataset_files(prefixes: List[str]) -> list:
    """``(prefix, path)`` for each ``.bin`` or ``.idx`` file of the indexed datasets ``prefixes`` that does not exist."""
    return [(prefix, path) for prefix in prefixes for path in (get_bin_path(prefix), get_idx_path(prefix))
            if not os.path.isfile(path)]


def every_split_problems(prefixes: List[str], split: str, sizes: List[int], split_flag: str = "data.split") -> None:
    """megatron.core loops forever building a split that received no document (its epochs never
    reach the requested samples): refuse that split by name first (``DataError``). ``sizes``: the
    samples asked of each split (0: not built); ``split_flag``: what the user set the split with."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import normalize

    given = f"{split_flag} {split}" if split_flag.startswith("--") else f"{split_flag}={split}"
    try:
        shares = normalize([float(part) for part in split.replace("/", ",").split(",")])
    except ValueError:
        raise DataError(f"{split_flag} {split!r} must be comma-separated numbers such as 98,1,1") from None
    for prefix in prefixes:
        documents = len(IndexedDataset(prefix).document_indices) - 1
        for index, name in enumerate(("train", "validation", "test")[:len(shares)]):
            # megatron.core gives split i int(round(share_i * documents)) documents
            # (a share of 0 asks for no such split: megatron.core builds none)
            if index < len(sizes) and sizes[index] and shares[index] > 0 and int(round(shares[index] * documents)) == 0:
                raise DataError(f"{given}: the {name} split of {prefix} gets none of its {documents} documents; give "
                                f"it a larger share (e.g. {given.replace(split, '90,5,5')}) or add documents")


def microbatches(dataset, start_sample: int, num_microbatches: int, micro_batch_size: int, attention_mask):
    """``num_microbatches`` batches of ``micro_batch_size`` consecutive samples from ``start_sample``, with
    ``attention_mask`` (one for every batch), or with the samples' own (``reset_attention_mask``: ``[b, 1, s,
    s]``, True where masked, as Megatron's)."""
    out = []
    for j in range(num_microbatches):
        first = start_sample + j * micro_batch_size
        samples = [dataset[(first + k) % len(dataset)] for k in range(micro_batch_size)]
        batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in
                 ("tokens", "labels", "loss_mask", "position_ids")}
        own = "attention_mask" in samples[0] and samples[0]["attention_mask"] is not None
        batch["attention_mask"] = torch.stack([torch.as_tensor(s["attention_mask"]) for s in samples]) if own \
            else attention_mask
        out.append(batch)
    return out
