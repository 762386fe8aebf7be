"""One microbatch for a Megatron model, and the one forward both Megatron trainers run on it.

fe-pretrain's Megatron engine (`fe_megatron.megatron.step`) and Megatron-LM's trainer with the drop-ins
(`fe_megatron.megatron_lm.steps`) hand their model a `Microbatch`: the tensors Megatron's GPT models
take, and the memory's inputs (`fe_megatron.memory.inputs.MemoryInputs`: addresses hashed before a
context-parallel split, or lookups started one microbatch ahead; None: the model hashes ``tokens``).
`forward_microbatch` is the call both make; their losses differ (the engine's mean, Megatron-LM's
token sum), and stay theirs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from fe_megatron.memory.inputs import MemoryInputs
from fe_megatron.tables.lookahead import MEMORY_INPUTS


class Microbatch(NamedTuple):
    tokens: Optional[torch.Tensor]  # [b, s] token ids
    labels: Optional[torch.Tensor]
    loss_mask: Optional[torch.Tensor]
    attention_mask: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    memory_inputs: Optional[MemoryInputs] = None
    loss_tokens: Optional[torch.Tensor] = None  # this rank's loss-mask tokens, on a stage with memory layers

    @classmethod
    def of(cls, batch: dict) -> "Microbatch":
        """The microbatch of one of fe-pretrain's batches (`fe_megatron.training.run.EngineRun.batches`, with
        the lookups the feed started ahead under ``memory_inputs``)."""
        return cls(batch["tokens"], batch.get("labels"), batch.get("loss_mask"), batch.get("attention_mask"),
                   batch.get("position_ids"), batch.get(MEMORY_INPUTS))


def forward_microbatch(model, batch: Microbatch):
    """The model's output on ``batch`` (its loss per token when it has labels): the one forward of both
    trainers. The memory's inputs go to the model only when there are any: a model without memory layers
    (Megatron's own GPT model) takes no such argument."""
    memory = {} if batch.memory_inputs is None else {"memory_inputs": batch.memory_inputs}
    return model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels,
                 loss_mask=batch.loss_mask, **memory)
