"""`FactorEngramGPTModel`: Megatron's GPTModel with memory indices for every memory layer."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from fe_megatron.config import MemoryConfig
from fe_megatron.memory.branch import start_stage_lookups
from fe_megatron.megatron.hasher import MicrobatchHasher
from fe_megatron.megatron.sparsity import pop_stage_sparsity_loss
from fe_megatron.megatron.transformer_layer import FactorEngramTransformerLayer


class FactorEngramGPTModel(GPTModel):
    """GPTModel whose forward hashes ``input_ids`` once per microbatch and passes the indices to
    the memory layers of this pipeline stage as the stock block's ``context`` argument
    (`fe_megatron.megatron.transformer_layer` says how).

    Same constructor and forward as GPTModel, plus ``memory_config`` and an optional
    ``memory_indices`` forward argument (precomputed ``{layer_index: [s, b, branches]}``,
    e.g. hashed before a context-parallel split).  Every pipeline stage that holds a
    memory layer needs ``input_ids`` (or ``memory_indices``), not only the first and last.
    The sparsity loss scale is set once per step with
    `fe_megatron.megatron.sparsity.SparsityLossAutoScaler.set_loss_scale`.
    """

    def __init__(self, config, transformer_layer_spec, vocab_size: int, max_sequence_length: int,
                 memory_config: MemoryConfig, prefetch_table_rows: bool = True, **gpt_model_kwargs):
        if memory_config.vocab_size > vocab_size:
            raise ValueError(f"MemoryConfig.vocab_size={memory_config.vocab_size} exceeds the model's "
                             f"vocab_size={vocab_size}")
        if getattr(config, "mtp_num_layers", None):
            raise ValueError("multi-token prediction (mtp_num_layers) is not supported with memory layers: the MTP "
                             "block refuses the decoder's context argument, which carries the memory indices")
        super().__init__(config, transformer_layer_spec, vocab_size, max_sequence_length, **gpt_model_kwargs)
        self.memory_config = memory_config
        self.stage_memory_layers = [layer for layer in self.decoder.layers
                                    if isinstance(layer, FactorEngramTransformerLayer) and layer.memory is not None]
        # a pipeline stage may hold no memory layer (the paper's layers 10 and 12 of 24 at PP=4): it hashes nothing
        self.hasher = MicrobatchHasher(memory_config, [layer.layer_index for layer in self.stage_memory_layers]) \
            if self.stage_memory_layers else None
        self.prefetch_table_rows = prefetch_table_rows
        start = 0  # each memory layer's columns when the indices travel stacked (full recompute)
        for layer in self.stage_memory_layers:
            width = memory_config.num_branches
            layer.memory_columns = (start, start + width)
            start += width

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs: Optional[dict] = None,
                runtime_gather_output=None, *, memory_indices: Optional[dict] = None, **kwargs):
        extra_block_kwargs = dict(extra_block_kwargs or {})
        if self.stage_memory_layers:
            memory_indices = self.hasher.for_forward(input_ids, memory_indices, self.config.context_parallel_size)
            if extra_block_kwargs.get("context") is not None:
                raise ValueError("FactorEngramGPTModel carries the memory indices in the decoder's context argument; "
                                 "extra_block_kwargs['context'] must not be set")
            if self.config.recompute_granularity == "full" and self.training:
                if not all(isinstance(value, torch.Tensor) for value in memory_indices.values()):
                    raise ValueError("under full recompute the memory indices must be tensors (the checkpointed "
                                     "layers take them as inputs), not lookups started ahead")
                # the checkpointed layers take their inputs as tensors: one tensor, each layer its columns
                extra_block_kwargs["context"] = torch.cat(
                    [memory_indices[layer.layer_index] for layer in self.stage_memory_layers], dim=-1)
            else:
                extra_block_kwargs["context"] = self._start_lookups(memory_indices)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                               inference_context=inference_context, packed_seq_params=packed_seq_params,
                               extra_block_kwargs=extra_block_kwargs, runtime_gather_output=runtime_gather_output,
                               **kwargs)

    def _start_lookups(self, memory_indices: dict) -> dict:
        """Start every memory layer's lookup now (prefetch) where there is one to start: row-sharded
        tables send their row requests (every layer of the stage in one exchange,
        `fe_megatron.tables.row_exchange.StageRowExchange`), tables in stores gather their rows, which
        then arrive while the layers before them compute; each layer waits only for its own.  Lookups started earlier
        (`start_memory_lookups`, the host tier's one-microbatch lookahead) are kept.  (Not under full
        recompute, whose checkpointed chunks take the indices as tensor inputs: the lookup then runs
        inside the layer, and again in the recomputation.)"""
        if not self.prefetch_table_rows:
            return memory_indices
        branches = {layer.layer_index: layer.memory for layer in self.stage_memory_layers}
        started = dict(memory_indices)
        started.update(start_stage_lookups(branches, {index: value for index, value in memory_indices.items()
                                                      if index in branches}))
        return started

    def start_memory_lookups(self, input_ids: torch.Tensor, device) -> dict:
        """``{layer_index: started lookup}`` of this stage's memory layers for ``input_ids`` ([b, s]),
        hashed where the ids are (the host tier hashes on the host, so starting needs no device
        synchronization) with the rows bound for ``device``; pass the result to ``forward`` as
        ``memory_indices``."""
        if self.hasher is None:
            return {}
        branches = {layer.layer_index: layer.memory for layer in self.stage_memory_layers}
        return start_stage_lookups(branches, self.hasher(input_ids), device)

    def pop_sparsity_loss(self) -> torch.Tensor:
        """lambda * L_sparsity summed over this stage's memory layers and the microbatches run since the
        last call, for this rank's TP share; sum over TP and PP ranks for the model's value."""
        return pop_stage_sparsity_loss(self.stage_memory_layers)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        # The memory branch lives on some layers only: store layers one by one.
        metadata = dict(metadata or {})
        metadata["non_homogeneous_layers"] = True
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)
