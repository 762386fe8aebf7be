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

Everything position-wise (the lookup, the gates, ``V``) runs once over the flat batch.  The hash and
the convolution, which read earlier positions, run over the flat batch too, with each request's
look-back laid before its new tokens (``RequestBatch.joined``: ``N + R h`` positions, so a long
prompt's chunk beside many decodes costs no padding), or, in a step of decodes only, on each
request's window of look-back and its one new token.  The result equals the branch run on each
request alone, token for token (tests/unit/vllm/test_request_history.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def state_shapes(memory_config) -> tuple:
    """The shapes of one request's look-back: ``(ids, values)``, ``[max(1, max_order - 1)]`` and ``[max(1, (K-1) r),
    output_size]``: at least one of each, since a server views a state as ``[slots, *shape]``, which an empty
    shape cannot be (the first ``max_order - 1`` and ``(K-1) r`` are used)."""
    receptive_field = (memory_config.conv_kernel_size - 1) * memory_config.conv_dilation
    return (max(1, memory_config.max_order - 1),), (max(1, receptive_field), memory_config.output_size)


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
        # a step of decodes only: one new token per request, each continuing (the steady state of serving)
        self.decoding = max(lengths, default=0) == 1 and bool(self.has_history.all())

    @classmethod
    def decodes(cls, slots: torch.Tensor) -> "RequestBatch":
        """A step of decodes only (one new token per request, each continuing), without the checks of lengths
        that a general batch needs."""
        batch = cls.__new__(cls)
        count = len(slots)
        batch.lengths = torch.ones(count, dtype=torch.int64, device=slots.device)
        batch.slots, batch.has_history = slots, torch.ones(count, dtype=torch.bool, device=slots.device)
        batch.num_tokens, batch.decoding = count, True
        return batch

    def start_or_keep(self, stored: torch.Tensor, empty) -> torch.Tensor:
        """``[R, ...]``: each request's look-back, its slot's ``stored`` rows where it has history and
        ``empty`` (a scalar) where it starts."""
        rows = stored[self.slots]
        keep = self.has_history.view(-1, *([1] * (rows.dim() - 1)))
        return torch.where(keep, rows, torch.full_like(rows, empty))

    def after_look_back(self, flat: torch.Tensor, state: torch.Tensor, history: int, empty) -> tuple:
        """Each request's new values of ``flat`` (``[N, ...]``) after its last ``history`` values in ``state``
        (``[slots, >= history, ...]``; ``empty``, a scalar, where the request starts), as sequences for a causal
        computation that reads ``history`` back: ``(sequences [B, T, ...], new)``, ``new`` indexing the new
        positions of a result laid out as ``sequences``. ``state`` advances, in place, to the last ``history``
        values of each request. A step of decodes only gives each request's window (``[R, history + 1, ...]``,
        its new value last); any other step one sequence of the requests end to end (`joined`)."""
        if self.decoding:
            sequences = torch.cat([state[self.slots, :history].to(flat.dtype), flat.unsqueeze(1)], 1)
            latest, new = sequences[:, 1:], (slice(None), history)
        else:
            joined, places, last = self.joined(flat, self.start_or_keep(state[:, :history].to(flat.dtype), empty))
            sequences, latest, new = joined.unsqueeze(0), joined[last], (0, places)
        if history:
            state[self.slots, :history] = latest.to(state.dtype)
        return sequences, new

    def joined(self, flat: torch.Tensor, history: torch.Tensor) -> tuple:
        """Each request's look-back (``history``, ``[R, h, ...]``) then its new values of ``flat`` (``[N, ...]``),
        the requests end to end: ``(joined [N + R h, ...], new, last)``, with ``new`` ``[N]`` the place of each new
        value in ``joined`` and ``last`` ``[R, h]`` the places of each request's last ``h`` values (the look-back
        its next step starts from). A position then reads, ``h`` back, only its own request's values."""
        h, device = history.shape[1], flat.device
        requests = torch.arange(len(self.lengths), device=device)
        starts = torch.cumsum(self.lengths, 0) - self.lengths + requests * h  # where each request's look-back begins
        request_of_token = torch.repeat_interleave(requests, self.lengths, output_size=self.num_tokens)
        new = torch.arange(self.num_tokens, device=device) + (request_of_token + 1) * h
        steps = torch.arange(h, device=device)
        joined = flat.new_empty((self.num_tokens + len(self.lengths) * h, *flat.shape[1:]))
        joined[new] = flat
        joined[(starts.unsqueeze(1) + steps).flatten()] = history.flatten(0, 1)
        return joined, new, (starts + self.lengths).unsqueeze(1) + steps


def addresses(branch, token_ids: torch.Tensor, batch: RequestBatch, id_state: torch.Tensor) -> torch.Tensor:
    """Eq. 1 for every token of the flat batch (``token_ids`` ``[N]``): ``[N, branches]`` row indices, each
    request's n-grams reading its earlier ids from ``id_state`` (``[slots, >= max_order - 1]`` int, the
    slots' last lookup ids), which is updated in place."""
    hasher = branch.hasher
    ids = hasher.lookup_ids(token_ids.unsqueeze(0)).squeeze(0)  # checks the ids' range (vocabulary)
    sequences, new = batch.after_look_back(ids, id_state, branch.config.max_order - 1, hasher.pad_id)
    return hasher.indices_of_lookup_ids(sequences)[new]


def refine(branch, values: torch.Tensor, batch: RequestBatch, value_state: torch.Tensor) -> torch.Tensor:
    """Eq. 10 for every token of the flat batch (``values`` ``[N, C]``): ``m_t = v_t + ShortConv(v)_t``, each
    request's convolution reading its earlier values from ``value_state`` (``[slots, >= (K-1) r, C]``, the
    slots' last values), which is updated in place."""
    conv = branch.conv
    sequences, new = batch.after_look_back(values, value_state, conv.receptive_field, 0.0)
    if batch.decoding:  # each window's last position, without the convolution's call overhead
        return values + conv.last(sequences)
    return values + conv(sequences)[new]
