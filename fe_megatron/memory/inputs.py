"""The memory's inputs for one microbatch: the one carrier from the batch to every memory layer, and the
one place that decides when each lookup starts.

The vocabulary, the same in every trainer (fe-pretrain's engines, the Megatron-LM drop-ins, Hugging Face):

- **token ids**: ``[batch, seq]`` ids of the microbatch, which the model hashes;
- **addresses**: a layer's Eq. 1 row indices, ``[.., branches]`` (`MemoryBranch.addresses`), hashed by the
  model, or by the batch before a context-parallel split; with a `Decoding`, after earlier calls' ids;
- **a started lookup**: `fe_megatron.tables.store.StartedLookup`, ``branch.start_lookup(addresses)``, whatever
  holds the tables (`fe_megatron.tables.holders`);
- **rows**: ``lookup.rows()``, the addressed table rows (Eq. 6's ``z_t`` before concatenation).

`MemoryInputs` carries a microbatch's addresses and started lookups, one field each: a batch that hashed
before a context-parallel split sends ``MemoryInputs(addresses=...)``, a trainer that started the lookups one
microbatch ahead sends ``MemoryInputs(lookups=...)``, and the model passes the same type to its layers after
`schedule_lookups` completed it (`MemoryInputs.complete`: hashes the layers nobody addressed). It starts a
lookup:

- **this forward** (``start_now``): every lookup when the forward starts, those of the layers whose tables
  are row-sharded over one group in one exchange (`start_lookups`), so the rows travel while the layers
  before them compute;
- **one microbatch ahead** (the host tier): `start_lookups` called by the trainer a microbatch early;
- **at each run of the layer** (``recomputed``, or ``start_now=False``): the layer's call starts its lookup
  from its addresses (`MemoryInputs.lookup_of`). A recomputed forward (full recompute, Hugging Face's
  gradient checkpointing) runs a layer twice, and a started lookup is read once, so there each run looks
  its rows up again.

The Megatron models (`fe_megatron.megatron.memory_inputs`) and the Hugging Face model
(`fe_megatron.hf.modeling_fe_megatron`) carry the same object to their layers.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional

import torch

from fe_megatron.memory.decoding import Decoding
from fe_megatron.tables.holders import start_exchanged_lookups
from fe_megatron.tables.store import StartedLookup


@dataclasses.dataclass(frozen=True)
class MemoryInputs:
    """A microbatch's memory inputs, by memory layer index: ``addresses`` (``[.., branches]`` row indices, the
    lookup not started yet), ``lookups`` (started lookups) and, token by token, ``decodings`` (padding, the
    convolution's look-back). A layer has addresses or a lookup, not both."""

    addresses: dict = dataclasses.field(default_factory=dict)
    lookups: dict = dataclasses.field(default_factory=dict)
    decodings: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        both = sorted(set(self.addresses) & set(self.lookups))
        if both:
            raise ValueError(f"memory layers {both} have both addresses and a started lookup; give each layer one")
        for index, value in self.addresses.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"memory layer {index}: addresses are a tensor of row indices, got a "
                                f"{type(value).__name__}")
        for index, value in self.lookups.items():
            if not isinstance(value, StartedLookup):
                raise TypeError(f"memory layer {index}: a started lookup (branch.start_lookup(addresses)), got a "
                                f"{type(value).__name__}")

    @property
    def layers(self) -> list:
        return sorted({*self.addresses, *self.lookups})

    def complete(self, layers, address: Callable[[int], torch.Tensor]) -> "MemoryInputs":
        """These inputs for ``layers``, each layer that has neither addresses nor a lookup addressed by
        ``address(index)`` (the model hashing its token ids); entries of other layers are dropped."""
        addresses = {index: self.addresses[index] if index in self.addresses else address(index)
                     for index in layers if index not in self.lookups}
        lookups = {index: self.lookups[index] for index in layers if index in self.lookups}
        return MemoryInputs(addresses, lookups, self.decodings)

    def addresses_of(self, layer_index: int) -> torch.Tensor:
        """Layer ``layer_index``'s addresses (a layer whose lookup each run starts itself)."""
        if layer_index not in self.addresses:
            raise RuntimeError(self._missing(layer_index, "addresses"))
        return self.addresses[layer_index]

    def lookup_of(self, layer_index: int, branch, device=None) -> StartedLookup:
        """Layer ``layer_index``'s lookup (of ``branch``): the one started for it, or one started now from its
        addresses, the rows bound for ``device`` (the layer's, where the hidden states are; by default the
        addresses')."""
        if layer_index in self.lookups:
            return self.lookups[layer_index]
        if layer_index in self.addresses:
            return branch.start_lookup(self.addresses[layer_index], device)
        raise RuntimeError(self._missing(layer_index, "memory inputs"))

    def decoding_of(self, layer_index: int) -> Optional[Decoding]:
        return self.decodings.get(layer_index)

    def _missing(self, layer_index: int, what: str) -> str:
        return (f"no {what} for memory layer {layer_index} in this forward (it has {self.layers}); build them "
                "with schedule_lookups over every memory layer")


def start_lookups(branches: dict, addresses: dict, device=None) -> dict:
    """``{layer index: started lookup}`` of memory ``branches`` (``{layer index: branch}``) for one forward's
    ``addresses`` (``{layer index: [.., branches] row indices}``), the rows bound for ``device`` (by default
    the addresses' device). The layers whose tables' holders share one exchange group (row-sharded tables
    over the same row group) start one exchange for all of them (one set of all-to-alls); the others start
    their own (`MemoryBranch.start_lookup`)."""
    lookups, exchanged = {}, {}
    for index, value in addresses.items():
        group = branches[index].tables.exchange_group
        if group is None:
            lookups[index] = branches[index].start_lookup(value, device)
        else:
            exchanged.setdefault(id(group), []).append(index)
    for layers in exchanged.values():
        started = start_exchanged_lookups(
            [branches[index].tables.holder for index in layers],
            [addresses[index].to(device if device is not None else addresses[index].device) for index in layers])
        lookups.update(zip(layers, started))
    return lookups


RENAMED_KEYWORDS = {"memory_indices": "MemoryInputs(addresses=...) for row indices",
                    "memory_lookups": "the MemoryInputs that start_memory_lookups returns"}


def refuse_renamed_keywords(kwargs: dict) -> None:
    """A clear error for the memory keywords the models took before `MemoryInputs` carried their inputs."""
    for old, new in RENAMED_KEYWORDS.items():
        if old in kwargs:
            raise TypeError(f"{old}= is now memory_inputs=: pass {new} (fe_megatron.memory.inputs)")


def given_inputs(inputs) -> "MemoryInputs":
    """``inputs`` as a `MemoryInputs` (None: none given), or a TypeError naming what was passed."""
    if inputs is None:
        return MemoryInputs()
    if not isinstance(inputs, MemoryInputs):
        raise TypeError(f"memory_inputs must be a fe_megatron.memory.inputs.MemoryInputs, got a "
                        f"{type(inputs).__name__}")
    return inputs


def _from_entries(entries: dict, decodings: Optional[dict]) -> MemoryInputs:
    """The `MemoryInputs` of the ``{layer: addresses or started lookup}`` dict earlier releases scheduled
    (the model file `fe-convert` copied next to weights converted between 2026-11-28 and 2026-11-29 passes
    one, with its decodings)."""
    warnings.warn("schedule_lookups takes a MemoryInputs; a dict of addresses and started lookups is deprecated",
                  DeprecationWarning, stacklevel=3)
    lookups = {index: entry for index, entry in entries.items() if isinstance(entry, StartedLookup)}
    addresses = {index: entry for index, entry in entries.items() if index not in lookups}
    return MemoryInputs(addresses, lookups, dict(decodings or {}))


def schedule_lookups(branches: dict, inputs: MemoryInputs, *, recomputed: bool, start_now: bool = True,
                     decodings: Optional[dict] = None) -> MemoryInputs:
    """This forward's `MemoryInputs` for ``branches`` (``{layer index: branch}``) from ``inputs`` (every
    layer's addresses, or a lookup started a microbatch ahead), per the module docstring: where the layers
    run twice (``recomputed``), the addresses, each run starting its own lookup (lookups started ahead are
    refused: they are read once); otherwise every lookup started now (``start_now``), or at each layer's run.
    Lookups started ahead are kept. (``decodings`` and a dict for ``inputs``: the call of converted folders'
    model files of 2026-11-28, deprecated.)"""
    if not isinstance(inputs, MemoryInputs):
        inputs = _from_entries(inputs, decodings)
    missing = [index for index in branches if index not in inputs.addresses and index not in inputs.lookups]
    if missing:
        raise ValueError(f"the memory inputs have no entry for memory layers {sorted(missing)} (they have "
                         f"{inputs.layers}); give every memory layer its addresses, or the token ids")
    addresses = {index: inputs.addresses[index] for index in branches if index in inputs.addresses}
    lookups = {index: inputs.lookups[index] for index in branches if index in inputs.lookups}
    if recomputed and lookups:
        raise ValueError(f"memory layers {sorted(lookups)}: where a forward is recomputed, the memory inputs must be "
                         "addresses or token ids (each run of a layer looks them up again), not lookups started "
                         "ahead (start_memory_lookups): pass those only without recompute")
    if start_now and not recomputed:
        lookups.update(start_lookups(branches, addresses))
        addresses = {}
    return MemoryInputs(addresses, lookups, inputs.decodings)
