"""The memory's incremental look-back: new positions of many sequences, each continuing from its last step.

A memory branch looks back a fixed distance: the n-gram address of position t reads ids ``t-n+1 .. t``
(Eq. 1) and the causal refinement reads values ``t, t-r, .., t-(K-1)r`` (Eq. 10).  So a decoder keeps, per
sequence, only its last ``h = max_order - 1`` lookup ids and its last ``h = (K-1) r`` values, and a step costs
the same whatever the context length.  This file is the one implementation of that look-back; transformers'
``generate`` (`fe_megatron.memory.decoding`) and vLLM (`fe_megatron.vllm.memory_layer`) both call it.

A step's new positions lie end to end in one flat sequence, request r's at ``starts[r] : starts[r] +
lengths[r]`` (`RequestBatch`): ``generate``'s batch is B requests of T tokens each; vLLM's a mix of whole
prompts, prompt chunks, single decoded tokens and speculative drafts.  Each request's look-back lives in
row ``slots[r]`` of a state tensor ``[slots, capacity, ...]``; a request without history (its first step, or
one a server preempted and recomputes) starts from the empty look-back: the hasher's ``pad_id`` for ids,
zeros for values, exactly as the full forward treats positions before t = 0.

Speculative decoding (a request's new tokens are its last token and draft tokens that the same step
verifies): the state keeps the look-back after *each* new position, ``state[j] = joined[j + 1]`` for ``j <
h + q - 1`` (``joined``: the request's look-back then its ``q`` new values), and the next step reads the
look-back at offset ``read_from``, the drafts it accepted (vLLM's ``num_accepted_tokens - 1``), so rejected drafts
leave it as if they had never been proposed.  Every other request keeps its last ``h`` values at offset 0.
This is the layout of vLLM's own convolution states (``conv_kernel - 1 + num_speculative_tokens`` entries,
read from ``num_accepted_tokens - 1``), so vLLM's block copies for prefix caching move it unchanged.

Everything position-wise (the lookup, the gates, ``V``) runs once over the flat batch; only the hash and the
convolution read earlier positions, and they run over each request's look-back laid before its new tokens:
as ``[R, h + T]`` windows when the caller says every request has the same number ``T`` of new tokens and none
verifies drafts (``generate``, and a server's step of plain decodes), else as one joined
sequence of ``N + R h`` positions (so a long prompt's chunk beside many decodes costs no padding).  The result
equals the branch run on each request alone, token for token (tests/unit/memory/test_look_back.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fe_megatron import ops


def history_lengths(memory_config) -> tuple:
    """``(ids, values)``: how far back a branch reads, ``max_order - 1`` ids and ``(K-1) r`` values."""
    return memory_config.max_order - 1, (memory_config.conv_kernel_size - 1) * memory_config.conv_dilation


def state_shapes(memory_config, speculative_tokens: int = 0) -> tuple:
    """The shapes of one request's look-back in a server's state cache: ``(ids, values)``, ``[max(1, max_order - 1)
    + k, 1]`` and ``[max(1, (K-1) r) + k, output_size]`` for ``k`` speculative tokens per step: at least one of each,
    since a server views a state as ``[slots, *shape]``, which an empty shape cannot be; both ``[position, channel]``,
    the layout of a convolution state, which vLLM copies at block boundaries (the ids' channel: ``[..., 0]``)."""
    ids, values = history_lengths(memory_config)
    return (max(1, ids) + speculative_tokens, 1), (max(1, values) + speculative_tokens, memory_config.output_size)


@dataclass
class RequestBatch:
    """Where each request's new tokens sit in the flat batch, which state slot it owns, and where its look-back is.

    lengths:     ``[R]`` int64, new tokens per request (the requests lie end to end, in this order);
    slots:       ``[R]`` int64, the request's row in the state tensors;
    has_history: ``[R]`` bool, whether the slot holds the request's look-back (False: it starts empty);
    num_tokens:  ``lengths.sum()``, given by the caller (no host synchronisation);
    uniform:     the number of new tokens of every request when they are all equal (their tokens then lie as
                 ``[R, uniform]``), else None;
    read_from:   ``[R]`` int64, the offset in the slot where the look-back begins: the drafts the last step accepted
                 (vLLM's ``num_accepted_tokens - 1``, which counts the bonus token); None: 0;
    speculative: ``[R]`` bool, the requests whose drafts this step verifies (their state keeps the look-back
                 after each new position); None: none;
    all_continue: every request has history (``has_history`` is all True; known without reading it).
    """

    lengths: torch.Tensor
    slots: torch.Tensor
    has_history: torch.Tensor
    num_tokens: int
    uniform: Optional[int] = None
    read_from: Optional[torch.Tensor] = None
    speculative: Optional[torch.Tensor] = None
    all_continue: bool = False

    @classmethod
    def of_lengths(cls, lengths: torch.Tensor, slots: torch.Tensor, has_history: torch.Tensor) -> "RequestBatch":
        """A batch whose lengths are checked on the host (tests, small batches): every request has a new token."""
        counts = lengths.tolist()
        if any(count < 1 for count in counts):
            raise ValueError(f"every request of a batch has at least one new token, got lengths {counts}")
        uniform = counts[0] if counts and all(count == counts[0] for count in counts) else None
        return cls(lengths, slots, has_history, int(sum(counts)), uniform)

    @classmethod
    def rows(cls, batch_size: int, new_tokens: int, device) -> "RequestBatch":
        """``batch_size`` sequences of ``new_tokens`` each, sequence b in slot b, all continuing (``generate``)."""
        return cls(torch.full((batch_size,), new_tokens, dtype=torch.int64, device=device),
                   torch.arange(batch_size, device=device), torch.ones(batch_size, dtype=torch.bool, device=device),
                   batch_size * new_tokens, new_tokens, all_continue=True)

    @property
    def windows(self) -> bool:
        """Whether the step lies as ``[R, h + T]`` windows: every request has ``uniform`` new tokens and none verifies
        drafts (whose look-back after each position only the joined layout keeps)."""
        return self.uniform is not None and self.speculative is None

    @property
    def plain_decodes(self) -> bool:
        """Whether every request has one new token, continues, and verifies no draft: a decoding step, which the fused
        kernels take in one pass per request (`fe_megatron.ops.ngram_hash_decode_`, ``short_conv_decode_``)."""
        return self.windows and self.uniform == 1 and self.all_continue

    def _look_back(self, state: torch.Tensor, history: int, empty, dtype) -> torch.Tensor:
        """``[R, history, ...]``: each request's look-back, read from its slot (at ``read_from``), ``empty`` where it
        starts."""
        if self.read_from is None:
            rows = state[self.slots, :history]
        else:
            steps = self.read_from.unsqueeze(1) + torch.arange(history, device=state.device)
            rows = state[self.slots.unsqueeze(1), steps]
        if self.all_continue:
            return rows.to(dtype)
        keep = self.has_history.view(-1, *([1] * (rows.dim() - 1)))
        return torch.where(keep, rows, torch.full_like(rows, empty)).to(dtype)

    def after_look_back(self, flat: torch.Tensor, state: torch.Tensor, history: int, empty) -> tuple:
        """Each request's new values of ``flat`` (``[N, ...]``) after its look-back of ``history`` values in ``state``
        (``[slots, >= history, ...]``; ``empty``, a scalar, where the request starts), as sequences for a causal
        computation that reads ``history`` back: ``(sequences [B, T, ...], new)``, ``new`` indexing the new
        positions of a result laid out as ``sequences``.  ``state`` advances in place (see the module's docstring).
        """
        look_back = self._look_back(state, history, empty, flat.dtype)
        if self.windows:  # [R, h + T]: each request's window, keeping its last h
            sequences = torch.cat([look_back, flat.view(len(self.slots), self.uniform, *flat.shape[1:])], 1)
            if history:
                state[self.slots, :history] = sequences[:, self.uniform:].to(state.dtype)
            return sequences, (slice(None), slice(history, None))
        joined, places, starts = self.joined(flat, look_back)  # one sequence of the requests end to end
        if history:
            self._keep(joined, starts, state, history)
        return joined.unsqueeze(0), (0, places)

    def _keep(self, joined: torch.Tensor, starts: torch.Tensor, state: torch.Tensor, history: int) -> None:
        """Write each request's next look-back into its slot: its last ``history`` values at offset 0, or, for a
        speculative request, the look-back after each of its new positions (``state[j] = joined[j + 1]``)."""
        last = history + self.lengths - 1  # each request's last place in its own part of ``joined``
        if self.speculative is None:
            kept, first = history, self.lengths
        else:
            kept = state.shape[1]
            first = torch.where(self.speculative, torch.ones_like(self.lengths), self.lengths)
        steps = torch.arange(kept, device=joined.device)
        places = starts.unsqueeze(1) + torch.minimum(first.unsqueeze(1) + steps, last.unsqueeze(1))
        state[self.slots.unsqueeze(1), steps] = joined[places].to(state.dtype)

    def joined(self, flat: torch.Tensor, history: torch.Tensor) -> tuple:
        """Each request's look-back (``history``, ``[R, h, ...]``) then its new values of ``flat`` (``[N, ...]``), the
        requests end to end: ``(joined [N + R h, ...], new, starts)``, with ``new`` ``[N]`` the place of each new value
        in ``joined`` and ``starts`` ``[R]`` where each request's look-back begins. A position then reads, ``h`` back,
        only its own request's values."""
        h, device = history.shape[1], flat.device
        requests = torch.arange(len(self.lengths), device=device)
        starts = torch.cumsum(self.lengths, 0) - self.lengths + requests * h
        request_of_token = torch.repeat_interleave(requests, self.lengths, output_size=self.num_tokens)
        new = torch.arange(self.num_tokens, device=device) + (request_of_token + 1) * h
        joined = flat.new_empty((self.num_tokens + len(self.lengths) * h, *flat.shape[1:]))
        joined[new] = flat
        joined[(starts.unsqueeze(1) + torch.arange(h, device=device)).flatten()] = history.flatten(0, 1)
        return joined, new, starts


def addresses(hasher, lookup_ids: torch.Tensor, batch: RequestBatch, id_state: torch.Tensor,
              position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eq. 1 for every new position (``lookup_ids`` ``[N]``, from `NgramHasher.lookup_ids`): ``[N, branches]`` row
    indices of every layer ``hasher`` addresses, each request's n-grams reading its earlier ids from ``id_state``
    (``[slots, >= max_order - 1]``), which advances in place.  ``position_ids`` (``[R, T]``, a uniform batch only):
    no n-gram reaches before its document (`fe_megatron.ngram.hashing.within_documents`)."""
    history = hasher.config.max_order - 1
    if batch.plain_decodes and position_ids is None and ops.fused_branch_enabled():  # one pass per request
        return hasher.indices_of_next_ids(lookup_ids, id_state, batch.slots)
    sequences, new = batch.after_look_back(lookup_ids, id_state, history, hasher.pad_id)
    return hasher.indices_of_lookup_ids(sequences, position_ids)[new].reshape(batch.num_tokens, -1)


def refine(conv, values: torch.Tensor, batch: RequestBatch, value_state: torch.Tensor) -> torch.Tensor:
    """Eq. 10 for every new position (``values`` ``[N, C]``): ``m_t = v_t + ShortConv(v)_t``, each request's
    convolution reading its earlier values from ``value_state`` (``[slots, >= (K-1) r, C]``), which advances in
    place."""
    history = conv.receptive_field
    if batch.plain_decodes and ops.fused_branch_enabled():
        return ops.short_conv_decode_(values, value_state, batch.slots, conv.norm.weight, conv.weight, conv.dilation,
                                      conv.norm.eps)  # one pass per request where the backend has the kernel
    sequences, new = batch.after_look_back(values, value_state, history, 0.0)
    if batch.windows and batch.uniform == 1:  # each window's last position, without the convolution's call overhead
        return values + conv.last(sequences)
    if batch.windows:
        return values + conv(sequences, history=history).flatten(0, 1)
    return values + conv(sequences)[new]


@dataclass
class ServedStep:
    """A branch's look-back in a server's step (the ``decoding`` of `MemoryBranch.forward`): the step's requests and
    this layer's value state; the addresses come hashed for every layer at once (`addresses`)."""

    batch: RequestBatch
    value_state: torch.Tensor
    valid = None
    has_loss = False  # a server's step: no sparsity term (Eq. 12) to compute

    def refine(self, conv, values: torch.Tensor) -> torch.Tensor:
        return refine(conv, values.flatten(0, 1), self.batch, self.value_state).view_as(values)
