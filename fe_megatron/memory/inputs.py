"""The memory's inputs for one forward, and the one place that decides when each lookup starts.

A memory branch reads its table rows through one protocol (`fe_megatron.tables.store.StartedLookup`):
``branch.start_lookup(addresses)`` returns a handle and ``handle.rows()`` the rows, whatever holds the tables
(a parameter of the module, a `TableStore` on the device or the host, rows sharded over a row group). The
addresses are Eq. 1's row indices (`MemoryBranch.addresses`: hashed by the model, before any
context-parallel split; with a `Decoding`, after earlier calls' ids).

A model builds one `MemoryInputs` per forward (per microbatch and pipeline stage) with `schedule_lookups`,
and each memory layer reads its entry (`MemoryInputs.lookup_of`). `schedule_lookups` starts a lookup:

- **this forward** (``start_now``): every lookup when the forward starts, those of the layers whose tables
  are row-sharded over one group in one exchange (`start_lookups`), so the rows travel while the layers
  before them compute;
- **one microbatch ahead** (the host tier): `start_lookups` called by the trainer a microbatch early; the
  started lookups come in as the addresses, and are kept;
- **at each run of the layer** (``recomputed``, or ``start_now=False``): the entry stays addresses, and the
  layer's call starts its lookup (`MemoryInputs.lookup_of`). A recomputed forward (full recompute, Hugging
  Face's gradient checkpointing) runs a layer twice, and a started lookup is read once, so there each run
  looks its rows up again.

The Megatron models (`fe_megatron.megatron.memory_inputs`) and the Hugging Face model
(`fe_megatron.hf.modeling_fe_megatron`) carry the same object to their layers.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fe_megatron.memory.decoding import Decoding
from fe_megatron.tables.row_exchange import StageRowExchange
from fe_megatron.tables.store import StartedLookup


@dataclasses.dataclass
class MemoryInputs:
    """One forward's memory inputs: ``lookups`` ``{memory layer index: its addresses ([.., branches] row
    indices, the lookup not started yet) or its started lookup}``, and, token by token, ``decodings``
    ``{memory layer index: its Decoding}`` (padding, the convolution's look-back)."""

    lookups: dict
    decodings: dict = dataclasses.field(default_factory=dict)

    def entry(self, layer_index: int):
        """Layer ``layer_index``'s addresses or started lookup, as scheduled."""
        if layer_index not in self.lookups:
            raise RuntimeError(f"no memory inputs for memory layer {layer_index} in this forward (it has "
                               f"{sorted(self.lookups)}); build them with schedule_lookups over every memory layer")
        return self.lookups[layer_index]

    def lookup_of(self, layer_index: int, branch, device=None) -> StartedLookup:
        """Layer ``layer_index``'s lookup (of ``branch``): the one started for it, or one started now, the
        rows bound for ``device`` (the layer's, where the hidden states are; by default the addresses')."""
        return started(self.entry(layer_index), branch, device)

    def decoding_of(self, layer_index: int) -> Optional[Decoding]:
        return self.decodings.get(layer_index)


def started(entry, branch, device=None) -> StartedLookup:
    """``entry`` (addresses, or a lookup started earlier) as a started lookup of ``branch``, one started now
    with its rows bound for ``device`` (by default the addresses')."""
    if isinstance(entry, torch.Tensor):
        return branch.start_lookup(entry, device)
    if not isinstance(entry, StartedLookup):
        raise TypeError(f"a memory layer's input is its addresses (a tensor of row indices) or a started lookup; "
                        f"got a {type(entry).__name__}: build the inputs with schedule_lookups")
    return entry


def start_lookups(branches: dict, addresses: dict, device=None) -> dict:
    """``{layer index: started lookup}`` of memory ``branches`` (``{layer index: branch}``) for one forward's
    ``addresses`` (``{layer index: [.., branches] row indices}``), the rows bound for ``device`` (by default
    the addresses' device). The layers whose tables are row-sharded over the same group share one
    `StageRowExchange` (one set of all-to-alls for all of them); the others start their own
    (`MemoryBranch.start_lookup`); entries that are started lookups already are kept."""
    lookups, sharded = {}, {}
    for index, value in addresses.items():
        branch = branches[index]
        if not isinstance(value, torch.Tensor):
            lookups[index] = started(value, branch)
        elif branch.row_partition is not None:
            sharded.setdefault(id(branch.parallel.memory_parallel_group), []).append(index)
        else:
            lookups[index] = branch.start_lookup(value, device)
    for layers in sharded.values():
        group = [branches[index] for index in layers]
        exchange = StageRowExchange(
            [b.tables.store for b in group],
            [addresses[index].to(device if device is not None else addresses[index].device) for index in layers],
            [b.row_partition for b in group], group[0].parallel.memory_parallel_group)
        lookups.update({index: exchange.layer_lookup(position) for position, index in enumerate(layers)})
    return lookups


def schedule_lookups(branches: dict, addresses: dict, *, recomputed: bool, start_now: bool = True,
                     decodings: Optional[dict] = None) -> MemoryInputs:
    """One forward's `MemoryInputs` for ``branches`` (``{layer index: branch}``) from ``addresses``
    (``{layer index: row indices, or a lookup started a microbatch ahead}``), per the module docstring:
    where the layers run twice (``recomputed``), the addresses, each run starting its own lookup (lookups
    started ahead are refused: they are read once); otherwise every lookup started now (``start_now``), or
    at each layer's run. Lookups started ahead are kept."""
    missing = sorted(index for index in branches if index not in addresses)
    if missing:
        raise ValueError(f"the memory inputs have no entry for memory layers {missing} (they have "
                         f"{sorted(addresses)}); give every memory layer its addresses, or the token ids")
    entries, decodings = {index: addresses[index] for index in branches}, dict(decodings or {})
    if recomputed:
        ahead = [index for index, entry in entries.items() if not isinstance(entry, torch.Tensor)]
        if ahead:
            raise ValueError(f"memory layers {ahead}: where a forward is recomputed, the memory inputs must be row "
                             "indices or token ids (each run of a layer looks them up again), not lookups started "
                             "ahead (start_memory_lookups): pass those only without recompute")
        return MemoryInputs(entries, decodings)
    if start_now:
        return MemoryInputs(start_lookups(branches, entries), decodings)
    return MemoryInputs(entries, decodings)
