"""Layer specs: drop FactorEngram into an existing Megatron-Core GPT config by swapping the spec."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Optional

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron import compat
from fe_megatron.megatron.norm import TorchNorm
from fe_megatron.megatron.transformer_layer import memory_layer_spec


def get_local_layer_spec(**spec_kwargs) -> ModuleSpec:
    """megatron.core's local GPT layer spec, with `TorchNorm` where megatron would fall back to
    its torch norm (no apex), so that sequence parallelism works."""
    spec = get_gpt_layer_local_spec(**spec_kwargs)
    sub = spec.submodules
    if sub.input_layernorm is WrappedTorchNorm or sub.pre_mlp_layernorm is WrappedTorchNorm:
        sub = dataclasses.replace(sub, input_layernorm=TorchNorm, pre_mlp_layernorm=TorchNorm)
        spec = dataclasses.replace(spec, submodules=sub)
    return spec


def get_gpt_layer_with_factorengram_spec(memory_config: MemoryConfig, backend: str = "local",
                                         table_sharding: str = "replicated", **spec_kwargs):
    """A GPT layer spec whose layers carry the memory branch on ``memory_config.layers``.

    backend: ``"local"`` (megatron.core's own modules; runs on CPU) or ``"te"``
    (Transformer Engine, optional). table_sharding: ``"replicated"`` (whole tables on every
    data-parallel rank) or ``"rows"`` (rows sharded over the tables' own row group, see
    `fe_megatron.megatron.memory_layer`). ``spec_kwargs`` go to megatron's spec function
    (e.g. ``qk_layernorm``, ``normalization``).
    """
    if backend == "local":
        base = get_local_layer_spec(**spec_kwargs)
    elif backend == "te":
        if importlib.util.find_spec("transformer_engine") is None:
            raise ImportError("backend='te' needs Transformer Engine, which is not installed here; use backend='local'")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        base = get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
    else:
        raise ValueError(f"backend must be 'local' or 'te', got {backend!r}")
    return memory_layer_spec(base, memory_config, table_sharding)


def get_block_spec(layer_spec: ModuleSpec, config, vp_stage: Optional[int] = None) -> ModuleSpec:
    """This pipeline stage's block spec for ``layer_spec``. For the local backend the final norm is
    `TorchNorm` too (megatron's default block would use its torch fallback, which refuses SP)."""
    num_layers = compat.num_layers_to_build(config, vp_stage, parallel_state.get_pipeline_model_parallel_rank())
    norm = TorchNorm if layer_spec.submodules.input_layernorm is TorchNorm else compat.default_block_norm()
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=norm))
