"""A memory branch over a server's batch: many requests' tokens in one flat sequence, each request
continuing from where its last step ended.

A server such as vLLM runs one forward over the new tokens of every scheduled request, laid end to
end: ``[N, hidden]``, request r's tokens at ``starts[r] : starts[r] + lengths[r]``.  A request's
tokens may be its whole prompt, one chunk of it (chunked prefill) or one decoded token.  The branch
looks back a fixed distance (`fe_megatron.memory.decoding`): the n-gram address of position t reads
ids ``t-n+1 .. t`` (Eq. 1) and the refinement reads values ``t, t-r, .., t-(K-1)r`` (Eq. 10).  So
each request keeps, in a slot of the server's state cache, its last ``max_order - 1`` lookup ids
and its last ``(K-1) r`` values; a request whose slot holds no history (its first chunk, or a
request the server preempted and recomputes) starts from the empty look-back, exactly as
`DecodingState.empty`.

Everything position-wise (the lookup, the gates, ``V``) runs once over the flat batch; only the
hash and the convolution, which read earlier positions, run per request, on the requests padded to
one ``[requests, history + longest, ...]`` tensor, or, in a step of decodes only, on each request's
window of look-back and its one new token.  The result equals the branch run on each request
alone, token for token (tests/unit/test_request_history.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RequestBatch:
    """Where each request's new tokens sit in the flat batch, and which state slot it owns.

    lengths:     ``[R]`` new tokens per request (the requests lie end to end, in this order);
    slots:       ``[R]`` int64, the request's slot in the state cache;
    has_history: ``[R]`` bool, whether the slot holds the request's look-back (False: it starts).
    """

    lengths: torch.Tensor
    slots: torch.Tensor
    has_history: torch.Tensor

    def __post_init__(self):
        lengths = self.lengths.tolist()
        if any(length < 1 for length in lengths):
            raise ValueError(f"every request of a batch has at least one new token, got lengths {lengths}")
        self.num_tokens = int(sum(lengths))
        self.longest = int(max(lengths, default=0))
        # a step of decodes only: one new token per request, each continuing (the steady state of serving)
        self.decoding = self.longest == 1 and bool(self.has_history.all())
        self._token_places = None

    @classmethod
    def decodes(cls, slots: torch.Tensor) -> "RequestBatch":
        """A step of decodes only (one new token per request, each continuing), without the checks of lengths
        that a general batch needs."""
        batch = cls.__new__(cls)
        count = len(slots)
        batch.lengths = torch.ones(count, dtype=torch.int64, device=slots.device)
        batch.slots, batch.has_history = slots, torch.ones(count, dtype=torch.bool, device=slots.device)
        batch.num_tokens, batch.longest, batch.decoding, batch._token_places = count, min(count, 1), True, None
        return batch

    def _places(self) -> tuple:
        """``(request, offset)`` of every token of the flat batch."""
        if self._token_places is None:
            device = self.lengths.device
            request = torch.repeat_interleave(torch.arange(len(self.lengths), device=device), self.lengths)
            starts = torch.cumsum(self.lengths, 0) - self.lengths
            self._token_places = request, torch.arange(self.num_tokens, device=device) - starts[request]
        return self._token_places

    def padded(self, flat: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """``[R, h + longest, ...]``: each request's ``history`` (``[R, h, ...]``) then its new values of
        ``flat`` (``[N, ...]``); the positions after a request's last one hold zeros."""
        h = history.shape[1]
        request, offset = self._places()
        out = flat.new_zeros((len(self.lengths), h + self.longest, *flat.shape[1:]))
        out[:, :h] = history
        out[request, h + offset] = flat
        return out

    def flat(self, padded: torch.Tensor) -> torch.Tensor:
        """The new positions of ``padded`` (``[R, longest, ...]``, no history) back in the flat layout."""
        return padded[self._places()]

    def last(self, padded: torch.Tensor, count: int) -> torch.Tensor:
        """``[R, count, ...]``: the last ``count`` positions of each request in ``padded`` (``[R, count +
        longest, ...]``, history first): the look-back its next step starts from."""
        steps = torch.arange(count, device=padded.device)
        return padded[torch.arange(len(self.lengths), device=padded.device).unsqueeze(1),
                      self.lengths.unsqueeze(1) + steps]

    def start_or_keep(self, stored: torch.Tensor, empty) -> torch.Tensor:
        """``[R, ...]``: each request's look-back, its slot's ``stored`` rows where it has history and
        ``empty`` (a scalar) where it starts."""
        rows = stored[self.slots]
        keep = self.has_history.view(-1, *([1] * (rows.dim() - 1)))
        return torch.where(keep, rows, torch.full_like(rows, empty))


def addresses(branch, token_ids: torch.Tensor, batch: RequestBatch, id_state: torch.Tensor) -> torch.Tensor:
    """Eq. 1 for every token of the flat batch (``token_ids`` ``[N]``): ``[N, branches]`` row indices, each
    request's n-grams reading its earlier ids from ``id_state`` (``[slots, >= max_order - 1]`` int, the
    slots' last lookup ids), which is updated in place."""
    hasher = branch.hasher
    history = branch.config.max_order - 1
    ids = hasher.lookup_ids(token_ids.unsqueeze(0)).squeeze(0)  # checks the ids' range (vocabulary)
    if batch.decoding:  # one new id per request: its window is the slot's ids and it
        window = torch.cat([id_state[batch.slots, :history].long(), ids.unsqueeze(1)], 1)
        if history:
            id_state[batch.slots, :history] = window[:, 1:].to(id_state.dtype)
        return hasher.indices_of_lookup_ids(window)[:, history]
    earlier = batch.start_or_keep(id_state[:, :history].long(), hasher.pad_id)
    padded = batch.padded(ids, earlier)  # after a request's end: zeros, which no position of it reads (Eq. 1)
    if history:
        id_state[batch.slots, :history] = batch.last(padded, history).to(id_state.dtype)
    return batch.flat(hasher.indices_of_lookup_ids(padded)[:, history:])


def refine(branch, values: torch.Tensor, batch: RequestBatch, value_state: torch.Tensor) -> torch.Tensor:
    """Eq. 10 for every token of the flat batch (``values`` ``[N, C]``): ``m_t = v_t + ShortConv(v)_t``, each
    request's convolution reading its earlier values from ``value_state`` (``[slots, (K-1) r, C]``), which is
    updated in place."""
    conv = branch.conv
    history = conv.receptive_field
    if batch.decoding:  # one new value per request: its window is the slot's values and it
        window = torch.cat([value_state[batch.slots].to(values.dtype), values.unsqueeze(1)], 1)
        if history:
            value_state[batch.slots] = window[:, 1:].to(value_state.dtype)
        return values + conv.last(window)
    earlier = batch.start_or_keep(value_state.to(values.dtype), 0.0)
    padded = batch.padded(values, earlier)
    refined = conv(padded, history=history)  # [R, longest, C]; each position reads only earlier ones
    if history:
        value_state[batch.slots] = batch.last(padded, history).to(value_state.dtype)
    return values + batch.flat(refined)

