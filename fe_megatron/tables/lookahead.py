"""The host tier's prefetch: each microbatch's table rows fetched one microbatch ahead of use.

A microbatch's table rows depend only on its token ids (Eq. 1), which a step knows for all its
microbatches before the first forward.  `MicrobatchLookups` walks a step's microbatches for an
engine: it hashes each one's token ids on the host, starts its lookups (`start`: the unique rows
gathered from host memory and copied to the device on a side stream,
`fe_megatron.tables.store`) as soon as the previous microbatch's forward has been issued
(`start_next`, called by the engine right after that forward), and hands them to the forward
that uses them.  The copies then overlap the previous microbatch's compute.  Lookups never cross
a step: the tables change at the optimizer step, so the first microbatch's rows are fetched when
the step begins.

Each microbatch dict must carry its token ids in host memory as ``host_tokens``, and its position ids as
``host_position_ids`` (documents packed into a sequence are hashed each on its own, `fe_megatron.ngram.hashing`),
as `fe_megatron.training.run.EngineRun.batches` makes them; the iterator yields the dicts with the started
lookups added as ``memory_inputs`` (the `fe_megatron.memory.inputs.MemoryInputs` that ``start`` returns).
`microbatch_feed` is the one feed both engines walk a step's microbatches with: without ``host_tokens`` it hands
the batches out as they are.
"""

from __future__ import annotations

from typing import Callable, Optional

HOST_TOKENS = "host_tokens"
HOST_POSITION_IDS = "host_position_ids"
MEMORY_INPUTS = "memory_inputs"


def microbatch_feed(batches: list, start: Callable[[object, object], object]) -> "MicrobatchLookups":
    """A step's microbatches for an engine: each one's lookups started one microbatch ahead by
    ``start(host_tokens, host_position_ids)`` when the batches carry ``host_tokens`` (the host tier without
    full recompute), else the batches as they are.  The engine calls ``start_next()`` once each forward is
    issued, either way."""
    return MicrobatchLookups(batches, start if batches and HOST_TOKENS in batches[0] else None)


class MicrobatchLookups:
    """An iterator over ``batches`` (dicts with ``host_tokens``) that adds each one's lookups,
    started one microbatch ahead by ``start(host_tokens, host_position_ids) -> MemoryInputs`` (``start`` None:
    the batches as they are, and `start_next` does nothing)."""

    def __init__(self, batches: list, start: Optional[Callable[[object, object], object]]):
        self.batches, self.start = list(batches), start
        self.position = 0  # the next microbatch to hand out
        self.ahead = None  # the lookups of microbatch `position`, once started
        self.started = 0  # lookups started so far (for tests and benchmarks)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.position >= len(self.batches):
            raise StopIteration
        if self.start is None:
            self.position += 1
            return self.batches[self.position - 1]
        if self.ahead is None:  # the step's first microbatch (or a caller that never called start_next)
            self.start_next()
        batch = dict(self.batches[self.position], **{MEMORY_INPUTS: self.ahead})
        self.position += 1
        self.ahead = None
        return batch

    def start_next(self) -> None:
        """Start the lookups of the next microbatch to be handed out (a no-op after the last)."""
        if self.start is not None and self.ahead is None and self.position < len(self.batches):
            batch = self.batches[self.position]
            self.ahead = self.start(batch[HOST_TOKENS], batch.get(HOST_POSITION_IDS))
            self.started += 1
