"""Layer specs: drop FactorEngram into an existing Megatron-Core GPT config by swapping the spec."""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron.transformer_layer import memory_layer_spec


def get_gpt_layer_with_factorengram_spec(memory_config: MemoryConfig, backend: str = "local", **spec_kwargs):
    """A GPT layer spec whose layers carry the memory branch on ``memory_config.layers``.

    backend: ``"local"`` (megatron.core's own modules; runs on CPU) or ``"te"``
    (Transformer Engine, optional). ``spec_kwargs`` go to megatron's spec function
    (e.g. ``qk_layernorm``, ``normalization``).
    """
    if backend == "local":
        base = get_gpt_layer_local_spec(**spec_kwargs)
    elif backend == "te":
        try:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            base = get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
        except (ImportError, AssertionError) as err:
            raise ImportError(f"backend='te' needs Transformer Engine, which is not importable here ({err}); "
                              "use backend='local'") from err
    else:
        raise ValueError(f"backend must be 'local' or 'te', got {backend!r}")
    return memory_layer_spec(base, memory_config)
