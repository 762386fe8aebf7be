"""The memory's inputs on one pipeline stage: one carrier, owned by the model, for the GPT and the hybrid model.

Once per microbatch the model's forward hashes the token ids for this stage's memory layers
(`fe_megatron.megatron.hasher.MicrobatchHasher`, before any context-parallel split), starts their lookups
(`fe_megatron.memory.branch.start_stage_lookups`: one row exchange for every row-sharded layer of the stage,
a gather for tables in stores) and hands the result, a `StageMemoryInputs`, to the stage's memory layers
for the length of that forward (`handed_to`). No megatron-core argument carries it, so megatron-core's
blocks and stacks (``TransformerBlock``, ``HybridStack``) run unchanged, and microbatches of a pipeline
schedule never share one: each forward hands its own and takes it back.

Full recompute runs a layer twice: inside the checkpoint's forward (grad disabled), and again in backward,
after later microbatches' forwards may have run. There the model hands the layers the hashed addresses
rather than started lookups (a started lookup is read once), and each memory layer queues the addresses of
every checkpointed forward and takes the oldest in each recomputation (`lookup_of_this_call`): Megatron's
schedules run the backwards of a stage's microbatches in the order of their forwards (one model chunk per
stage, as the memory requires). The lookup, and with row-sharded tables its row exchange, runs again there.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from fe_megatron.memory.branch import start_stage_lookups


@dataclasses.dataclass
class StageMemoryInputs:
    """One microbatch's memory inputs on one pipeline stage: ``{memory layer index: its row indices
    ([s, b, branches]) or the lookup started for them}``."""

    lookups: dict

    def of(self, layer_index: int):
        if layer_index not in self.lookups:
            raise RuntimeError(f"no memory inputs for memory layer {layer_index} in this microbatch (it has "
                               f"{sorted(self.lookups)})")
        return self.lookups[layer_index]


def stage_branches(layers: list) -> dict:
    """``{block: branch}`` of a stage's memory ``layers`` (`HostsMemory` layers with a branch)."""
    return {layer.memory_index: layer.memory for layer in layers}


def lookups_started_ahead(layers: list, hasher, input_ids: torch.Tensor, device) -> dict:
    """``{block: started lookup}`` of a stage's memory ``layers`` for ``input_ids`` ([b, s]), hashed by
    ``hasher`` where the ids are (the host tier hashes on the host, so starting needs no device
    synchronization), the rows bound for ``device``: a model's ``memory_indices`` one microbatch ahead."""
    if hasher is None:
        return {}
    return start_stage_lookups(stage_branches(layers), hasher(input_ids), device)


def stage_memory_inputs(config, training: bool, branches: dict, addresses: dict,
                        start_lookups: bool = True) -> StageMemoryInputs:
    """This forward's `StageMemoryInputs` for ``branches`` (``{layer index: branch}``) from ``addresses``
    (``{layer index: [s, b, branches] row indices, or a lookup started earlier}``): the lookups started now
    (``start_lookups``; the host tier's started one microbatch ahead are kept), or, under full recompute
    while training, the addresses themselves (see the module docstring)."""
    missing = sorted(index for index in branches if index not in addresses)
    if missing:
        raise ValueError(f"memory_indices has no entry for memory layers {missing} of this pipeline stage (it has "
                         f"{sorted(addresses)}); give every memory layer of the stage its indices, or input_ids")
    if config.recompute_granularity == "full" and training:
        started = [index for index in branches if not isinstance(addresses[index], torch.Tensor)]
        if started:
            raise ValueError(f"memory layers {started}: under full recompute the memory inputs must be row indices "
                             "(each recomputation looks them up again), not lookups started ahead")
        return StageMemoryInputs({index: addresses[index] for index in branches})
    if not start_lookups:
        return StageMemoryInputs({index: addresses[index] for index in branches})
    return StageMemoryInputs(start_stage_lookups(branches, {index: addresses[index] for index in branches}))


@contextlib.contextmanager
def handed_to(layers: list, inputs: StageMemoryInputs):
    """``inputs`` on each of ``layers`` (their ``memory_inputs``) for the length of the block: one forward."""
    for layer in layers:
        layer.memory_inputs = inputs
    try:
        yield
    finally:
        for layer in layers:
            layer.memory_inputs = None


def lookup_of_this_call(layer):
    """What memory ``layer`` (a `HostsMemory` layer: ``memory_index``, ``memory_inputs`` set by its model,
    ``pending_recomputations``) reads in this call: the model's for this forward, or, in a full recompute's
    recomputation (in backward, no forward of the model running), what its checkpointed forward queued."""
    recomputing_fully = layer.config.recompute_granularity == "full" and layer.training
    if layer.memory_inputs is not None:
        lookup = layer.memory_inputs.of(layer.memory_index)
        if recomputing_fully and not torch.is_grad_enabled():  # the checkpoint's forward: recomputed later
            layer.pending_recomputations.append(lookup)
        return lookup
    if recomputing_fully and torch.is_grad_enabled() and layer.pending_recomputations:
        return layer.pending_recomputations.popleft()
    raise RuntimeError(f"the memory layer of block {layer.memory_index} (layer {layer.layer_number - 1}, 0-based) "
                       "got no memory inputs: run it inside its model's forward (FactorEngramGPTModel or "
                       "FactorEngramHybridModel), with input_ids (or memory_indices) on every pipeline stage")
