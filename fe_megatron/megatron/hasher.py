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
from fe_megatron.memory.inputs import MemoryInputs, given_inputs
from fe_megatron.ngram import NgramHasher


class MicrobatchHasher:
    def __init__(self, memory_config: MemoryConfig, layers=None):
        self.memory_config = memory_config
        self.layers = list(memory_config.layers if layers is None else layers)
        self.hasher = NgramHasher(memory_config, self.layers)  # only this stage's layers

    def __call__(self, token_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> dict:
        """``[b, s]`` token ids -> ``{layer_index: [s, b, branches] addresses}`` for this stage's memory layers;
        with ``position_ids`` (reset to 0 where a packed document starts: ``--reset-position-ids``), no n-gram
        reaches before its document (`fe_megatron.ngram.hashing`)."""
        per_layer = self.hasher.indices_per_layer(token_ids, position_ids=position_ids)
        return {layer: indices.transpose(0, 1).contiguous() for layer, indices in per_layer.items()}

    def for_forward(self, token_ids: Optional[torch.Tensor], memory_inputs: Optional[MemoryInputs],
                    context_parallel_size: int, position_ids: Optional[torch.Tensor] = None) -> MemoryInputs:
        """A model forward's `MemoryInputs` for this stage's layers: ``memory_inputs`` (addresses hashed by the
        batch, lookups started ahead) where they address a layer, the other layers hashed here from
        ``token_ids``; refused where that cannot be (a context-parallel split, a stage without token ids)."""
        given = given_inputs(memory_inputs)
        if all(layer in given.layers for layer in self.layers):
            return given.complete(self.layers, None)
        if context_parallel_size > 1:
            raise ValueError("with context parallelism the n-grams must be hashed on the full sequence before the "
                             "split: pass memory_inputs=MemoryInputs(addresses=hash_then_split_for_context_parallel"
                             "(...))")
        if token_ids is None:
            raise ValueError(f"this pipeline stage holds memory layers {self.layers} and needs input_ids (or "
                             "memory_inputs); give token ids to every pipeline stage")
        return given.complete(self.layers, self(token_ids, position_ids).__getitem__)


def hash_then_split_for_context_parallel(hasher: MicrobatchHasher, token_ids: torch.Tensor, cp_size: int,
                                         cp_rank: int, position_ids: Optional[torch.Tensor] = None) -> dict:
    """``{layer_index: addresses}``: the full sequence hashed (within its documents, with ``position_ids``), then
    this CP rank's chunks kept in Megatron's load-balanced order (chunks ``cp_rank`` and ``2 cp_size - 1 -
    cp_rank`` of ``2 cp_size``)."""
    indices = hasher(token_ids, position_ids)
    if cp_size == 1:
        return indices
    seq = token_ids.shape[1]
    if seq % (2 * cp_size):
        raise ValueError(f"sequence length {seq} is not divisible by 2 * context_parallel_size = {2 * cp_size}")
    chunk = seq // (2 * cp_size)
    keep = torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)])
    return {layer: idx.index_select(0, keep.to(idx.device)) for layer, idx in indices.items()}
