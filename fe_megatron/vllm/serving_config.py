"""What vLLM's configuration must be for a FactorEngram model, set before the engine starts.

vLLM calls ``verify_and_update_config`` of the class registered for an architecture in
``MODELS_CONFIG_MAP`` while it builds its configuration, before the model or the scheduler exist.

* **Prefix caching is turned off**, saying so.  A cached prefix lets a request skip the forward of
  its first tokens, but the memory's look-back (the last ids and values, kept per request and not per
  cache block) would then start empty in the middle of the text: not the model's output.  vLLM turns
  prefix caching on by default, so it is turned off here rather than refused, as vLLM itself does for
  layers it cannot cache.
* **The model runs eagerly** (``enforce_eager``).  Each step's requests are laid out on the host
  (`fe_megatron.vllm.request_history`), which neither a CUDA graph nor torch.compile captures.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig

logger = init_logger(__name__)


class FactorEngramServingConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        cache_config, model_config = vllm_config.cache_config, vllm_config.model_config
        if cache_config.enable_prefix_caching:
            logger.warning("prefix caching is off for this FactorEngram model: a request that skipped its cached "
                           "prefix would start the memory's look-back empty mid-text (docs/serving.md)")
            cache_config.enable_prefix_caching = False
        if not model_config.enforce_eager:
            logger.info("a FactorEngram model runs eagerly (enforce_eager): its memory layers lay out each step's "
                        "requests on the host, which CUDA graphs and torch.compile do not capture")
            model_config.enforce_eager = True
