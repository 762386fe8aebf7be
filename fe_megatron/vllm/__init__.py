"""The vLLM side of fe_megatron: serve a converted FactorEngram model with vLLM.

Installing fe_megatron registers `register` under vLLM's ``vllm.general_plugins`` entry point, so
every vLLM process (the API server, the engine core, each worker) loads it before it reads a
model's config.  It registers:

* the Hugging Face config of ``model_type: fe_megatron`` with transformers (`fe_megatron.hf`), so
  the folder ``fe-convert mcore-to-hf`` writes loads without ``--trust-remote-code``;
* ``FactorEngramForCausalLM`` (`fe_megatron.vllm.model`) with vLLM's `ModelRegistry`;
* `FactorEngramServingConfig`, which checks what the memory cannot serve and keeps the rest of vLLM's defaults.

Then ``vllm serve <converted folder>`` (or ``vllm.LLM(<folder>)``) serves it.  docs/serving.md
says what is supported and what is refused.
"""

from __future__ import annotations

ARCHITECTURE = "FactorEngramForCausalLM"


def register() -> None:
    """vLLM's plugin entry point (idempotent)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import fe_megatron.hf  # noqa: F401 - registers FactorEngramConfig with transformers' AutoConfig
    from fe_megatron.vllm.serving_config import FactorEngramServingConfig

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "fe_megatron.vllm.model:FactorEngramForCausalLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = FactorEngramServingConfig
