"""Module-level layer specs for Megatron-LM's ``--spec MODULE NAME``.

Megatron-LM imports the object without calling it, so the memory configuration comes
from the environment when this module is imported:

* ``FE_MEMORY_CONFIG``: a YAML file of MemoryConfig fields, or a training config (its ``memory:``
  section, with its ``model:`` section as the backbone), or
* ``FE_MEMORY_PRESET``: a preset name (default ``factorengram-340m``).

Objects: ``factorengram_local_spec`` (megatron.core modules) and, when Transformer
Engine is installed, ``factorengram_te_spec``.

    FE_MEMORY_PRESET=factorengram-340m python pretrain_gpt.py ... \
        --spec fe_megatron.megatron.megatron_lm_spec factorengram_te_spec

The model must still be a `FactorEngramGPTModel` and every pipeline stage must get the
token ids; see examples/megatron_lm/README.md.  Importing this module changes nothing global: for the
tables' gradients to go straight into Megatron's ``main_grad`` (rather than through a dense gradient), the
script installs `fe_megatron.megatron.main_grad.use_main_grad_accumulation` in the patch scope it trains
in (`fe_megatron.megatron_lm.custom_script.with_factorengram` does).
"""

import importlib.util
import os

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron.layer_specs import get_gpt_layer_with_factorengram_spec


def memory_config_from_environment() -> MemoryConfig:
    path = os.environ.get("FE_MEMORY_CONFIG")
    if path:
        return MemoryConfig.from_yaml(path)
    return MemoryConfig.from_preset(os.environ.get("FE_MEMORY_PRESET", "factorengram-340m"))


memory_config = memory_config_from_environment()
factorengram_local_spec = get_gpt_layer_with_factorengram_spec(memory_config, backend="local")
if importlib.util.find_spec("transformer_engine") is not None:
    factorengram_te_spec = get_gpt_layer_with_factorengram_spec(memory_config, backend="te")
