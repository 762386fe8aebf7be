"""What a memory branch needs to run token by token in ``generate``: padding masks and its incremental state
(the look-back itself is `fe_megatron.memory.look_back`, which vLLM's batches share).

A branch looks back a fixed distance: the n-gram address of position t reads ids
``t-n+1 .. t`` (Eq. 1), and the causal refinement reads values ``t, t-r, .., t-(K-1)r``
(Eq. 10).  So a decoder keeps, per sequence and per branch, only the last ``max_order - 1``
ids (in the addressing's id space, `NgramHasher.lookup_ids`) and the last ``(K-1) r`` values
``v``; a decoding step then costs the same whatever the context length.

Padding: positions where ``valid`` is False (left padding of a batch) are treated as lying
before the sequence start, exactly as the full forward treats positions before t = 0: their
id is the hasher's ``pad_id`` and their value enters the convolution as zero.  A left-padded
sequence therefore gets the same memory output as the same sequence unpadded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fe_megatron.memory import look_back
from fe_megatron.memory.look_back import RequestBatch


@dataclass
class DecodingState:
    """One branch's look-back for a batch of sequences (updated in place by each call).

    recent_ids:    ``[batch, max_order - 1]`` int64 ids in the addressing's id space.
    recent_values: ``[batch, (K-1) * r, output_size]`` values ``v`` before the convolution's norm.
    """

    recent_ids: torch.Tensor
    recent_values: torch.Tensor

    @classmethod
    def empty(cls, branch, batch_size: int, device, dtype) -> "DecodingState":
        """The state before the first token: every look-back position lies before the start."""
        ids = torch.full((batch_size, branch.config.max_order - 1), branch.hasher.pad_id, dtype=torch.int64,
                         device=device)
        values = torch.zeros(batch_size, branch.conv.receptive_field, branch.config.output_size, device=device,
                             dtype=dtype)
        return cls(ids, values)

    def select(self, batch_index: torch.Tensor) -> "DecodingState":
        """The state of sequences ``batch_index`` (beam reordering, batch selection)."""
        return DecodingState(self.recent_ids.index_select(0, batch_index.to(self.recent_ids.device)),
                             self.recent_values.index_select(0, batch_index.to(self.recent_values.device)))

    def repeat_interleave(self, repeats: int) -> "DecodingState":
        return DecodingState(self.recent_ids.repeat_interleave(repeats, 0),
                             self.recent_values.repeat_interleave(repeats, 0))


@dataclass
class Decoding:
    """How a branch call sits in a sequence: ``valid`` ``[batch, seq]`` (False = padding) and the
    ``state`` carried over from earlier calls (None: the call starts the sequences)."""

    valid: Optional[torch.Tensor] = None
    has_loss = True  # the model may add the sparsity term (Eq. 12) to a loss: generate's forward can take labels
    state: Optional[DecodingState] = None

    def indices(self, branch, token_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Eq. 1 for the new positions, reading the state's ids before them; updates the state.  With the new
        positions' ``position_ids``, no n-gram reaches before its document (`NgramHasher.indices`)."""
        hasher = branch.hasher
        ids = hasher.lookup_ids(token_ids)
        if self.valid is not None:
            ids = ids.masked_fill(~self.valid, hasher.pad_id)
        if self.state is None:
            return hasher.indices_of_lookup_ids(ids, position_ids)
        batch = RequestBatch.rows(*ids.shape, ids.device)
        return look_back.addresses(hasher, ids.flatten(), batch, self.state.recent_ids,
                                   position_ids).view(*ids.shape, -1)

    def refine(self, conv, values: torch.Tensor) -> torch.Tensor:
        """Eq. 10 for the new positions, reading the state's values before them; updates the state."""
        if self.valid is not None:
            values = values * self.valid.unsqueeze(-1).to(values.dtype)
        if self.state is None:
            return values + conv(values)
        batch = RequestBatch.rows(*values.shape[:2], values.device)
        return look_back.refine(conv, values.flatten(0, 1), batch, self.state.recent_values).view_as(values)
