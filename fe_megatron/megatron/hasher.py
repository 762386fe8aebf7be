"""Address computation for a microbatch (the memory analogue of the MoE router).

The model hashes the whole ``[batch, seq]`` id tensor once per microbatch, for all
insertion layers in one kernel call, and hands the per-layer indices (sequence-first,
``[s, b, branches]``) to the layers.  Hashing needs the ``max_order - 1`` previous
tokens of every position, so it must see the full sequence: under context parallelism
hash before the sequence is split across CP ranks (`hash_then_split_for_context_parallel`).
"""

from __future__ import annotations

from typing import Optional

import torch

from fe_megatron.config import MemoryConfig
from fe_megatron.ngram import NgramHasher


class MicrobatchHasher:
    def __init__(self, memory_config: MemoryConfig, layers=None):
        self.memory_config = memory_config
        self.layers = list(memory_config.layers if layers is None else layers)
        self.hasher = NgramHasher(memory_config, self.layers)  # only this stage's layers

    def __call__(self, input_ids: torch.Tensor) -> dict:
        """``[b, s]`` ids -> ``{layer_index: [s, b, branches]}`` for this stage's memory layers."""
        per_layer = self.hasher.indices_per_layer(input_ids)
        return {layer: indices.transpose(0, 1).contiguous() for layer, indices in per_layer.items()}

    def for_forward(self, input_ids: Optional[torch.Tensor], memory_indices: Optional[dict],
                    context_parallel_size: int) -> dict:
        """A model forward's indices: ``memory_indices`` where given, else ``input_ids`` hashed here;
        refused where that cannot be (a context-parallel split, a stage without token ids)."""
        if memory_indices is not None:
            return memory_indices
        if context_parallel_size > 1:
            raise ValueError("with context parallelism the n-grams must be hashed on the full sequence before "
                             "the split: pass memory_indices=hash_then_split_for_context_parallel(...)")
        if input_ids is None:
            raise ValueError(f"this pipeline stage holds memory layers {self.layers} and needs input_ids (or "
                             "memory_indices); give token ids to every pipeline stage")
        return self(input_ids)


def hash_then_split_for_context_parallel(hasher: MicrobatchHasher, input_ids: torch.Tensor, cp_size: int,
                                         cp_rank: int) -> dict:
    """Hash the full sequence, then keep this CP rank's chunks in Megatron's load-balanced order
    (chunks ``cp_rank`` and ``2 cp_size - 1 - cp_rank`` of ``2 cp_size``)."""
    indices = hasher(input_ids)
    if cp_size == 1:
        return indices
    seq = input_ids.shape[1]
    if seq % (2 * cp_size):
        raise ValueError(f"sequence length {seq} is not divisible by 2 * context_parallel_size = {2 * cp_size}")
    chunk = seq // (2 * cp_size)
    keep = torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)])
    return {layer: idx.index_select(0, keep.to(idx.device)) for layer, idx in indices.items()}
