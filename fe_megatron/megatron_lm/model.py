"""The model Megatron-LM's trainer builds: its own GPT or hybrid builder, with the memory branch added.

megatron.training (0.19) builds models from a ``GPTModelConfig`` through the builder class its
``builder`` field names. `FactorEngramGPTModelConfig` names `FactorEngramGPTModelBuilder`, which
runs Megatron-LM's `GPTModelBuilder` unchanged: the same layer spec from the same arguments
(Transformer Engine or local, MoE, qk-layernorm, heterogeneous layers, ``--spec``), the same
model arguments (rotary settings, untied embeddings, vocabulary padding, pre/post-process and
virtual stages). Three things change: the layer spec gets the memory branch on the configured
layers (`with_memory`); the model is a `FactorEngramGPTModel`, which hashes the token ids once
per microbatch for those layers; and where the table plan keeps the tables in stores, the built
model is handed to ``tables_into_stores`` before the trainer wraps it in DDP.

`FactorEngramHybridModelConfig` does the same for ``pretrain_hybrid``: Megatron-LM's `HybridModelBuilder`
unchanged, but the model is a `FactorEngramHybridModel` (the memory before the attention of the chosen
attention layers), and where Transformer Engine is missing, the stack is megatron-core's local layers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Optional

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig, default_layer_spec
from megatron.training.models.hybrid import HybridModelBuilder, HybridModelConfig

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron import compat
from fe_megatron.megatron.gpt_model import FactorEngramGPTModel
from fe_megatron.megatron.table_optimizer import refuse_tables_left_to_ddp
from fe_megatron.megatron.transformer_layer import memory_layer_spec


def with_memory(spec, memory_config: MemoryConfig, table_sharding: str):
    """``spec`` (a layer spec, or a block spec of per-layer specs as MoE and heterogeneous models
    have) with the memory branch on ``memory_config.layers``; every other submodule unchanged."""
    if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, TransformerBlockSubmodules):
        return dataclasses.replace(spec, submodules=with_memory(spec.submodules, memory_config, table_sharding))
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[memory_layer_spec(layer, memory_config, table_sharding)
                                                      for layer in spec.layer_specs])
    if isinstance(spec, ModuleSpec):
        return memory_layer_spec(spec, memory_config, table_sharding)
    raise TypeError(f"cannot add the memory branch to a layer spec of type {type(spec).__name__}; expected a "
                    "ModuleSpec or TransformerBlockSubmodules (what --spec must name)")


def with_project_norm(spec, config, vp_stage=None):
    """``spec`` with `TorchNorm` wherever megatron-core fell back to its own torch norm
    (``WrappedTorchNorm``: no Transformer Engine or Apex here), which refuses sequence parallelism;
    a layer spec becomes this stage's block spec, so that the final norm is `TorchNorm` too (as
    fe-pretrain's `get_block_spec` builds it). Other specs are returned unchanged."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from fe_megatron.megatron.layer_specs import get_block_spec
    from fe_megatron.megatron.norm import TorchNorm

    def swapped(layer):
        sub = layer.submodules
        if not isinstance(sub, TransformerLayerSubmodules) or WrappedTorchNorm not in (sub.input_layernorm,
                                                                                      sub.pre_mlp_layernorm):
            return layer
        changes = {name: TorchNorm for name in ("input_layernorm", "pre_mlp_layernorm")
                   if getattr(sub, name) is WrappedTorchNorm}
        return dataclasses.replace(layer, submodules=dataclasses.replace(sub, **changes))

    if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, TransformerBlockSubmodules):
        return dataclasses.replace(spec, submodules=with_project_norm(spec.submodules, config, vp_stage))
    if isinstance(spec, TransformerBlockSubmodules):
        norm = TorchNorm if spec.layer_norm is WrappedTorchNorm else spec.layer_norm
        return dataclasses.replace(spec, layer_specs=[swapped(layer) for layer in spec.layer_specs], layer_norm=norm)
    if isinstance(spec, ModuleSpec) and swapped(spec) is not spec:
        return get_block_spec(swapped(spec), config, vp_stage)
    return spec


@dataclasses.dataclass(kw_only=True)
class FactorEngramGPTModelConfig(GPTModelConfig):
    """Megatron-LM's GPT model configuration plus the memory branch (``memory_config``, whose
    backbone is the model's; None: the stock GPT model) and where its tables live. Without
    Transformer Engine or Apex its norms are the project's (`with_project_norm`)."""

    builder = "fe_megatron.megatron_lm.model.FactorEngramGPTModelBuilder"
    memory_config: Optional[MemoryConfig] = None
    table_sharding: str = "replicated"
    # called with each built model before the trainer wraps it in DDP, where the table plan keeps the tables
    # in stores (`fe_megatron.megatron_lm.run.TrainerState.take_tables`)
    tables_into_stores: Optional[Callable] = None


class FactorEngramGPTModelBuilder(GPTModelBuilder):
    """`GPTModelBuilder` whose layer spec carries the memory branch and whose model class is
    `FactorEngramGPTModel` (`compat.building_gpt_model_as`); without a memory configuration, the
    stock GPT model with the project's norms where megatron-core would use its torch norm."""

    def __init__(self, model_config: FactorEngramGPTModelConfig):
        stock_spec = model_config.transformer_layer_spec
        memory, sharding = model_config.memory_config, model_config.table_sharding

        def layer_spec_with_memory(config, vp_stage=None):
            spec = stock_spec
            if spec is None:
                spec = default_layer_spec(config, vp_stage)
            elif not isinstance(spec, (ModuleSpec, TransformerBlockSubmodules)) and callable(spec):
                takes_vp = "vp_stage" in inspect.signature(spec).parameters
                spec = spec(config, vp_stage=vp_stage) if takes_vp else spec(config)
            if memory is not None:
                spec = with_memory(spec, memory, sharding)
            return with_project_norm(spec, config, vp_stage)

        super().__init__(dataclasses.replace(model_config, transformer_layer_spec=layer_spec_with_memory))

    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        config = self._model_config
        if config.memory_config is None:
            return super().build_model(pg_collection, pre_process, post_process, vp_stage)
        with compat.building_gpt_model_as(functools.partial(FactorEngramGPTModel, memory_config=config.memory_config)):
            model = super().build_model(pg_collection, pre_process, post_process, vp_stage)
        if config.tables_into_stores is not None:
            config.tables_into_stores(model)
        else:
            refuse_tables_left_to_ddp(config.memory_config, config.table_sharding, "FactorEngramGPTModelConfig")
        return model


def hybrid_stack_spec_for(config):
    """The hybrid stack spec Megatron-LM's builder would use, or, where Transformer Engine is not installed or
    ``--transformer-impl local`` asks for megatron-core's own layers, the local stack
    (`fe_megatron.megatron.hybrid_specs.local_hybrid_stack_spec`): megatron-core 0.19's default stack is
    built from Transformer Engine modules only."""
    import importlib.util

    from fe_megatron.megatron.hybrid_specs import local_hybrid_stack_spec

    if config.hybrid_stack_spec is not None:
        return config.hybrid_stack_spec
    if config.transformer.transformer_impl == "local" or importlib.util.find_spec("transformer_engine") is None:
        return local_hybrid_stack_spec(num_experts=config.transformer.num_moe_experts,
                                       moe_grouped_gemm=config.transformer.moe_grouped_gemm)
    return None  # Megatron-LM's default


@dataclasses.dataclass(kw_only=True)
class FactorEngramHybridModelConfig(HybridModelConfig):
    """Megatron-LM's hybrid model configuration plus the memory branch (``memory_config``, whose layers are
    blocks: the pattern's attention layers; None: the stock hybrid model) and where its tables live, as
    `FactorEngramGPTModelConfig` for the GPT model."""

    builder = "fe_megatron.megatron_lm.model.FactorEngramHybridModelBuilder"
    memory_config: Optional[MemoryConfig] = None
    table_sharding: str = "replicated"
    tables_into_stores: Optional[Callable] = None


class FactorEngramHybridModelBuilder(HybridModelBuilder):
    """`HybridModelBuilder` whose model is `FactorEngramHybridModel` (the memory before the attention of the
    chosen attention layers; `compat.building_hybrid_model_as`), on megatron-core's local layers where
    Transformer Engine is missing (`hybrid_stack_spec_for`); without a memory configuration, the stock
    HybridModel on that stack."""

    def __init__(self, model_config: FactorEngramHybridModelConfig):
        spec = hybrid_stack_spec_for(model_config)
        if spec is not None:
            model_config = dataclasses.replace(model_config, hybrid_stack_spec=spec)
        super().__init__(model_config)

    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        from fe_megatron.megatron.hybrid_model import FactorEngramHybridModel

        config = self._model_config
        if config.memory_config is None:
            return super().build_model(pg_collection, pre_process, post_process, vp_stage)
        model_class = functools.partial(FactorEngramHybridModel, memory_config=config.memory_config,
                                        table_sharding=config.table_sharding)
        with compat.building_hybrid_model_as(model_class):
            model = super().build_model(pg_collection, pre_process, post_process, vp_stage)
        if config.tables_into_stores is not None:
            config.tables_into_stores(model)
        else:
            refuse_tables_left_to_ddp(config.memory_config, config.table_sharding, "FactorEngramHybridModelConfig")
        return model
