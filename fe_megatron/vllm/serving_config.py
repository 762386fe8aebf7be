"""What vLLM's configuration must be for a FactorEngram model, checked and set before the engine starts.

vLLM calls ``verify_and_update_config`` of the class registered for an architecture in
``MODELS_CONFIG_MAP`` while it builds its configuration, in the process that builds it (the API
server, or the script that makes a `vllm.LLM`), before any worker starts.

* **Refused, by name**: what the memory cannot serve exactly.
  - speculative decoding: the memory's look-back cannot be rolled back after rejected draft tokens;
  - a KV connector (``kv_transfer_config``): keys and values computed elsewhere would make a request
    start mid-text, without the look-back the memory layers would have written;
  - prompts as embeddings (``enable_prompt_embeds``): the memory addresses its tables by token id, and
    with the flag vLLM passes no token ids at all;
  - a ``table_storage`` other than ``"memory"`` or ``"mmap"``.
  Pipeline parallelism vLLM refuses itself: the model does not declare it.
* **Prefix caching is turned off**, saying so.  A cached prefix lets a request skip the forward of
  its first tokens, but the memory's look-back (kept per request, not per cache block) would then start
  empty in the middle of the text.  vLLM turns prefix caching on by default, so it is turned off here
  rather than refused, as vLLM itself does for layers it cannot cache.
* **The model runs eagerly** (``enforce_eager``).  Each step's requests are laid out on the host
  (`fe_megatron.vllm.request_history`), which neither a CUDA graph nor torch.compile captures.
* **The vLLM internals** the memory layers read are checked (`memory_layer.check_vllm_internals`).
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from fe_megatron.hf.mmap_tables import TABLE_STORAGES
from fe_megatron.vllm.memory_layer import check_vllm_internals

logger = init_logger(__name__)


def refusals(vllm_config) -> list:
    """What in ``vllm_config`` a FactorEngram model cannot serve exactly, each with what to do instead."""
    model_config = vllm_config.model_config
    problems = []
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding: the memory's look-back cannot be rolled back after rejected draft "
                        "tokens; serve without --speculative-config")
    if vllm_config.kv_transfer_config is not None:
        problems.append("a KV connector (--kv-transfer-config): a request whose keys and values come from elsewhere "
                        "would start without the memory's look-back; serve without one")
    if getattr(model_config, "enable_prompt_embeds", False):
        problems.append("prompts as embeddings (--enable-prompt-embeds): the memory addresses its tables by token "
                        "id; serve without the flag and send token ids or text")
    storage = getattr(model_config.hf_config, "table_storage", "memory")
    if storage not in TABLE_STORAGES:
        problems.append(f"table_storage={storage!r}: use one of {list(TABLE_STORAGES)} (--hf-overrides "
                        "'{\"table_storage\": \"mmap\"}' maps the tables from the file)")
    return problems


class FactorEngramServingConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        check_vllm_internals()
        problems = refusals(vllm_config)
        if problems:
            raise ValueError("a FactorEngram model cannot be served with " + "; ".join(problems))
        cache_config, model_config = vllm_config.cache_config, vllm_config.model_config
        if cache_config.enable_prefix_caching:
            logger.warning("prefix caching is off for this FactorEngram model: a request that skipped its cached "
                           "prefix would start the memory's look-back empty mid-text (docs/serving.md)")
            cache_config.enable_prefix_caching = False
        if not model_config.enforce_eager:
            logger.info("a FactorEngram model runs eagerly (enforce_eager): its memory layers lay out each step's "
                        "requests on the host, which CUDA graphs and torch.compile do not capture")
            model_config.enforce_eager = True
