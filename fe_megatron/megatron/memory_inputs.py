"""The memory's inputs on one pipeline stage of a Megatron model, the GPT or the hybrid one.

Once per microbatch the model's forward hashes the token ids for this stage's memory layers
(`fe_megatron.megatron.hasher.MicrobatchHasher`, before any context-parallel split), schedules their lookups
(`fe_megatron.memory.inputs.schedule_lookups`: started now, one row exchange for every row-sharded layer of
the stage; or started one microbatch ahead for the host tier; or started again at each run under full
recompute) and hands the result, a `fe_megatron.memory.inputs.MemoryInputs`, to the stage's memory layers
for the length of that forward (`handed_to`). No megatron-core argument carries it, so megatron-core's
blocks and stacks (``TransformerBlock``, ``HybridStack``) run unchanged, and microbatches of a pipeline
schedule never share one: each forward hands its own and takes it back.

Full recompute runs a layer twice: inside the checkpoint's forward (grad disabled), and again in backward,
after later microbatches' forwards may have run, when no forward of the model hands it anything. There the
inputs hold the hashed addresses (a started lookup is read once), and each memory layer queues the addresses
of every checkpointed forward and takes the oldest in each recomputation (`lookup_of_this_call`): Megatron's
schedules run the backwards of a stage's microbatches in the order of their forwards (one model chunk per
stage, as the memory requires). The lookup, and with row-sharded tables its row exchange, runs again there.
"""

from __future__ import annotations

import contextlib

import torch

from fe_megatron.memory.inputs import MemoryInputs, schedule_lookups, start_lookups
from fe_megatron.tables.store import StartedLookup


def stage_branches(layers: list) -> dict:
    """``{block: branch}`` of a stage's memory ``layers`` (`HostsMemory` layers with a branch)."""
    return {layer.memory_index: layer.memory for layer in layers}


def recomputed_fully(config, training: bool) -> bool:
    """Whether this model's layers run twice per microbatch (full recompute, while training)."""
    return config.recompute_granularity == "full" and training


def lookups_started_ahead(layers: list, hasher, token_ids: torch.Tensor, device, position_ids=None) -> MemoryInputs:
    """The `MemoryInputs` of a stage's memory ``layers`` for ``token_ids`` ([b, s]; within the documents of
    ``position_ids``) with every lookup started now, hashed by ``hasher`` where the ids are (the host tier hashes
    on the host, so starting needs no device synchronization), the rows bound for ``device``: a model's
    ``memory_inputs`` one microbatch ahead."""
    if hasher is None:
        return MemoryInputs()
    return MemoryInputs(lookups=start_lookups(stage_branches(layers), hasher(token_ids, position_ids), device))


def stage_memory_inputs(config, training: bool, branches: dict, inputs: MemoryInputs,
                        start_lookups_now: bool = True) -> MemoryInputs:
    """This forward's `MemoryInputs` for ``branches`` (``{block: branch}``) from ``inputs`` (every block's
    ``[s, b, branches]`` addresses, or its lookup started a microbatch ahead), per
    `fe_megatron.memory.inputs.schedule_lookups`."""
    return schedule_lookups(branches, inputs, recomputed=recomputed_fully(config, training),
                            start_now=start_lookups_now)


@contextlib.contextmanager
def handed_to(layers: list, inputs: MemoryInputs):
    """``inputs`` on each of ``layers`` (their ``memory_inputs``) for the length of the block: one forward."""
    for layer in layers:
        layer.memory_inputs = inputs
    try:
        yield
    finally:
        for layer in layers:
            layer.memory_inputs = None


def lookup_of_this_call(layer, device) -> StartedLookup:
    """The lookup memory ``layer`` (a `HostsMemory` layer: ``memory_index``, ``memory``, ``memory_inputs``
    set by its model, ``pending_recomputations``) reads in this call: its model's for this forward, or, in a
    full recompute's recomputation (in backward, no forward of the model running), one started from the
    addresses its checkpointed forward queued; one started now has its rows bound for ``device`` (the
    layer's hidden states')."""
    recomputing_fully = recomputed_fully(layer.config, layer.training)
    if layer.memory_inputs is not None:
        if recomputing_fully and not torch.is_grad_enabled():  # the checkpoint's forward: recomputed later
            layer.pending_recomputations.append(layer.memory_inputs.addresses_of(layer.memory_index))
        return layer.memory_inputs.lookup_of(layer.memory_index, layer.memory, device)
    if recomputing_fully and torch.is_grad_enabled() and layer.pending_recomputations:
        return layer.memory.start_lookup(layer.pending_recomputations.popleft(), device)
    raise RuntimeError(f"the memory layer of block {layer.memory_index} (layer {layer.layer_number - 1}, 0-based) "
                       "got no memory inputs: run it inside its model's forward (FactorEngramGPTModel or "
                       "FactorEngramHybridModel), with input_ids (or memory_inputs) on every pipeline stage")
