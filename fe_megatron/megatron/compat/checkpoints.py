"""megatron-core's ``dist_checkpointing`` as fe_megatron uses it: the checkpoint writer's result queue,
where a release reads a checkpoint's common state, and a GPT checkpoint with memory loaded into a
hybrid model (fe-pretrain's loader, and Megatron-LM's trainer through its own retargeting, repaired).
The contracts (`fe_megatron.megatron.compat.contracts`) check each on the installed release."""

from __future__ import annotations

from typing import Callable

from fe_megatron.megatron.compat.versions import megatron_core_version
from fe_megatron.megatron.patches import PatchScope


def install_checkpoint_writer_queue(make_queue: Callable) -> None:
    """megatron-core's checkpoint writer collects results through a module-level queue
    (``filesystem_async._results_queue``), created on first use from a manager process of its own;
    give it ``make_queue()`` instead, unless one exists already."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = make_queue()


def reads_common_state_inside_torch_dist() -> bool:
    """Whether this release reads a checkpoint's common state from inside its torch_dist files, where
    newer releases write it, besides a ``common.pt`` of its own, where 0.16 writes it."""
    from megatron.core.dist_checkpointing import serialization

    return hasattr(serialization, "_legacy_common_state_exists")


def unreadable_checkpoint_problem(folder: str, written_by: str | None) -> str | None:
    """Why the installed megatron-core cannot read the dist checkpoint ``folder`` (None: it can).
    ``written_by`` names the megatron-core release that wrote it, where known."""
    import os

    if os.path.exists(os.path.join(folder, "common.pt")) or reads_common_state_inside_torch_dist():
        return None
    writer = f"megatron-core {written_by}" if written_by else "a newer megatron-core"
    return (f"{folder} was written by {writer}, which keeps a checkpoint's common state inside its torch_dist "
            f"files; megatron-core {megatron_core_version()}, installed here, reads it only from a common.pt "
            f"file and cannot load this checkpoint. Resume it with {writer} (docs/compatibility.md), or "
            "carry its weights over into a new run: fe-convert mcore-to-hf under the newer release, then fe-convert "
            "hf-to-mcore here, and --load the result")


def repair_gpt_to_hybrid_memory_load(scope: PatchScope) -> None:
    """megatron-core 0.19 loads a GPT checkpoint into a HybridModel run by pointing the hybrid model's
    sharded state dict at the GPT checkpoint's keys (``gpt_checkpoint_interop``): ``decoder.layers.<i>.X``
    becomes ``decoder.layers.X`` with GPT layer ``g`` as a prepended axis, the format of a GPT model whose
    layers are all alike. A GPT model with memory has unlike layers (the memory is on some), so its
    checkpoints store every layer under its own index, ``decoder.layers.<g>.X``, and upstream's keys miss
    them all. For a hybrid model with memory the retargeting maps each layer to its GPT layer's own keys
    instead (`_retarget_to_gpt_layers`), the model and the optimizer state alike, until ``scope`` closes."""
    from megatron.core.dist_checkpointing import gpt_checkpoint_interop as interop

    if interop.retarget_sharded_state_dict_to_gpt_checkpoint is not _retarget_to_gpt_layers:
        scope.replace(interop, "retarget_sharded_state_dict_to_gpt_checkpoint", _retarget_to_gpt_layers)


def point_hybrid_state_at_gpt_checkpoint(sharded_state_dict, hybrid_layer_pattern: str) -> None:
    """``sharded_state_dict`` (a hybrid model's, or its optimizer's) pointed, in place, at the keys of a
    checkpoint the GPT model with memory wrote (fe-pretrain's loader; `repair_gpt_to_hybrid_memory_load` says
    why upstream's retargeting does not fit). The pattern must pair each attention layer with one MLP or MoE
    layer (megatron-core's ``gpt_compatible_layer_maps`` says what it refuses)."""
    from megatron.core.dist_checkpointing import gpt_checkpoint_interop as interop

    _retarget_to_gpt_layers(sharded_state_dict, interop.gpt_compatible_layer_maps(hybrid_layer_pattern))


def _retarget_to_gpt_layers(sharded_state_dict, layer_maps) -> None:
    """Each hybrid layer's entries at its GPT layer's own keys (``decoder.layers.<g>.``), ``decoder.final_norm``
    at ``decoder.final_layernorm``, and the local-only ``output_layer._extra_state`` kept local, as upstream's
    ``retarget_sharded_state_dict_to_gpt_checkpoint`` does them."""
    from megatron.core.dist_checkpointing import gpt_checkpoint_interop as interop

    def retarget(entry):
        if not isinstance(entry, interop.ShardedBase):
            return entry
        if entry.key.endswith(interop._GPT_OMITTED_LOCAL_KEYS):
            return interop.LocalNonpersistentObject(entry.data)
        match = interop._DECODER_LAYER_KEY_RE.search(entry.key)
        if match is not None:
            hybrid_layer = int(match.group(1))
            gpt_layer = layer_maps.attention_to_gpt.get(hybrid_layer, layer_maps.mlp_to_gpt.get(hybrid_layer))
            if gpt_layer is None:
                raise ValueError(f"{entry.key}: hybrid layer {hybrid_layer} has no GPT layer to load from (a GPT "
                                 "checkpoint with memory loads into '*' and '-' or 'E' layers only)")
            entry.key = f"{entry.key[:match.start()]}decoder.layers.{gpt_layer}.{entry.key[match.end():]}"
            return entry
        for hybrid_prefix, gpt_prefix in interop._GPT_FINAL_NORM_KEY_MAP.items():
            if hybrid_prefix in entry.key:
                entry.key = entry.key.replace(hybrid_prefix, gpt_prefix, 1)
        return entry

    interop.dict_list_map_inplace(retarget, sharded_state_dict)
