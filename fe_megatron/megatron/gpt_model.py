"""`FactorEngramGPTModel`: Megatron's GPTModel handing its memory layers their inputs, once per microbatch."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron.hasher import MicrobatchHasher
from fe_megatron.megatron.memory_inputs import (handed_to, lookups_started_ahead, stage_branches,
                                                stage_memory_inputs)
from fe_megatron.megatron.sparsity import pop_stage_sparsity_loss
from fe_megatron.megatron.transformer_layer import FactorEngramTransformerLayer
from fe_megatron.memory.inputs import MemoryInputs, refuse_renamed_keywords


class FactorEngramGPTModel(GPTModel):
    """GPTModel whose forward hashes ``input_ids`` once per microbatch and hands the memory inputs to the
    memory layers of this pipeline stage for the length of that forward (`fe_megatron.megatron.memory_inputs`).

    Same constructor and forward as GPTModel, plus ``memory_config`` and an optional
    ``memory_inputs`` forward argument (a `fe_megatron.memory.inputs.MemoryInputs`: addresses
    ``{layer_index: [s, b, branches]}`` hashed before a context-parallel split, or lookups started ahead by
    `start_memory_lookups`). Every pipeline stage that holds a memory layer needs ``input_ids`` (or
    ``memory_inputs``), not only
    the first and last. The sparsity loss scale is set once per step with
    `fe_megatron.megatron.sparsity.SparsityLossAutoScaler.set_loss_scale`.
    """

    def __init__(self, config, transformer_layer_spec, vocab_size: int, max_sequence_length: int,
                 memory_config: MemoryConfig, prefetch_table_rows: bool = True, **gpt_model_kwargs):
        if memory_config.vocab_size > vocab_size:
            raise ValueError(f"MemoryConfig.vocab_size={memory_config.vocab_size} exceeds the model's "
                             f"vocab_size={vocab_size}")
        if getattr(config, "mtp_num_layers", None):
            raise ValueError("multi-token prediction (mtp_num_layers) is not supported with memory layers: the MTP "
                             "block's layers get no memory inputs")
        super().__init__(config, transformer_layer_spec, vocab_size, max_sequence_length, **gpt_model_kwargs)
        self.memory_config = memory_config
        self.stage_memory_layers = [layer for layer in self.decoder.layers
                                    if isinstance(layer, FactorEngramTransformerLayer) and layer.memory is not None]
        # a pipeline stage may hold no memory layer (the paper's layers 10 and 12 of 24 at PP=4): it hashes nothing
        self.hasher = MicrobatchHasher(memory_config, [layer.layer_index for layer in self.stage_memory_layers]) \
            if self.stage_memory_layers else None
        # start the stage's lookups when the forward starts (the rows arrive while the layers before them
        # compute); False: each layer looks its rows up when it runs
        self.prefetch_table_rows = prefetch_table_rows

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, extra_block_kwargs: Optional[dict] = None,
                runtime_gather_output=None, *, memory_inputs: Optional[MemoryInputs] = None, **kwargs):
        refuse_renamed_keywords(kwargs)
        def gpt_forward():
            return super(FactorEngramGPTModel, self).forward(
                input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                inference_context=inference_context, packed_seq_params=packed_seq_params,
                extra_block_kwargs=extra_block_kwargs, runtime_gather_output=runtime_gather_output, **kwargs)

        if not self.stage_memory_layers:
            return gpt_forward()
        inputs = self.hasher.for_forward(input_ids, memory_inputs, self.config.context_parallel_size, position_ids)
        inputs = stage_memory_inputs(self.config, self.training, stage_branches(self.stage_memory_layers), inputs,
                                     start_lookups_now=self.prefetch_table_rows)
        with handed_to(self.stage_memory_layers, inputs):
            return gpt_forward()

    def start_memory_lookups(self, token_ids: torch.Tensor, device, position_ids=None) -> MemoryInputs:
        """The `MemoryInputs` of this stage's memory layers for ``token_ids`` ([b, s]; within the documents of
        ``position_ids``) with every lookup started now, hashed where the ids are (the host tier hashes on the
        host, so starting needs no device synchronization) with the rows bound for ``device``; pass the result
        to ``forward`` as ``memory_inputs``."""
        return lookups_started_ahead(self.stage_memory_layers, self.hasher, token_ids, device, position_ids)

    def pop_sparsity_loss(self) -> torch.Tensor:
        """lambda * L_sparsity summed over this stage's memory layers and the microbatches run since the
        last call, for this rank's TP share; sum over TP and PP ranks for the model's value."""
        return pop_stage_sparsity_loss(self.stage_memory_layers)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        # The memory branch lives on some layers only: store layers one by one.
        metadata = dict(metadata or {})
        metadata["non_homogeneous_layers"] = True
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)
