"""What vLLM's configuration must be for a FactorEngram model, checked and set before the engine starts.

vLLM calls ``verify_and_update_config`` of the class registered for an architecture in
``MODELS_CONFIG_MAP`` while it builds its configuration, in the process that builds it (the API
server, or the script that makes a `vllm.LLM`), before any worker starts.

* **Refused, by name**: what the memory cannot serve exactly.
  - a KV connector (``kv_transfer_config``): keys and values computed elsewhere would make a request
    start mid-text, without the look-back the memory layers would have written;
  - prompts as embeddings (``enable_prompt_embeds``): the memory addresses its tables by token id, and
    with the flag vLLM passes no token ids at all;
  - a ``table_storage`` other than ``"memory"`` or ``"mmap"``.
  Pipeline parallelism vLLM refuses itself: the model does not declare it.
* **vLLM's defaults are kept**: the model compiles (the memory runs as custom ops, which the compiler leaves
  whole; `MEMORY_OPS` join the ops vLLM splits its CUDA graphs at, and on a GPU the graphs are piecewise, between
  them: `piecewise_graphs_on_a_gpu`), prefix caching stays on (vLLM's align
  mode keeps each memory layer's look-back at block boundaries), and speculative decoding verifies drafts
  against a look-back that rolls back to the accepted ones (`fe_megatron.memory.look_back`).
* **On a CPU, speculative decoding turns prefix caching off**, saying so: vLLM's CPU build cannot run both for a
  model with per-request state (`speculate_without_prefix_caching_on_a_cpu`).
* **On a CPU, the cache is capped at what the engine can use** (`cpu_cache_cap`).  vLLM's CPU backend reads
  ``--gpu-memory-utilization`` as the share of the host's memory to reserve, 0.92 by default: on a 24 GiB
  machine it took 21 GiB for the KV cache of a model whose ``max_num_seqs`` requests of ``max_model_len``
  tokens need a few MB, and left the machine nothing.  Unless ``--kv-cache-memory-bytes`` (or
  ``VLLM_CPU_KVCACHE_SPACE``) says how much, the cache gets what those requests can fill, with a margin, and
  never more than the flag asks; a line says so, naming both flags.
* **A folder served in another dtype than its own** is said once (vLLM's ``--dtype auto`` serves a float32
  folder in bfloat16), instead of a warning per memory weight.
* **The vLLM internals** the memory layers read are checked (`memory_layer.check_vllm_internals`).
"""

from __future__ import annotations

import math
import os

import torch
import vllm
from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from fe_megatron.hf.mmap_tables import TABLE_STORAGES
from fe_megatron.memory.look_back import state_shapes
from fe_megatron.vllm.memory_layer import MEMORY_OPS, check_vllm_internals, state_dtypes

# the CPU cache's margin over what the requests can fill: vLLM pads a hybrid model's pages to one size
CACHE_MARGIN, CACHE_MARGIN_BYTES = 2, 64 * 2 ** 20

logger = init_logger(__name__)


def refusals(vllm_config) -> list:
    """What in ``vllm_config`` a FactorEngram model cannot serve exactly, each with what to do instead."""
    model_config = vllm_config.model_config
    problems = []
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


def cache_bytes_needed(vllm_config) -> int:
    """What the KV cache and the memory layers' states of ``max_num_seqs`` requests of ``max_model_len`` tokens
    can fill: every layer's keys and values for each token (a block more per request), every memory layer's
    look-back per request, times `CACHE_MARGIN`, plus `CACHE_MARGIN_BYTES`."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    requests = vllm_config.scheduler_config.max_num_seqs
    value_bytes = torch.tensor([], dtype=model.dtype).element_size()
    token_bytes = 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size() * \
        value_bytes
    tokens = requests * (model.max_model_len + (cache.block_size or 16))
    state_bytes = 0
    memory_config = model.hf_config.memory_config()
    if memory_config is not None:
        state_bytes = len(memory_config.layers) * sum(
            math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
            for shape, dtype in zip(state_shapes(memory_config, vllm_config.num_speculative_tokens),
                                    state_dtypes(model.dtype)))
    return CACHE_MARGIN * (tokens * token_bytes + requests * state_bytes) + CACHE_MARGIN_BYTES


def cpu_cache_cap(vllm_config, host_memory_bytes: int):
    """The KV cache's size on a CPU where the user gave none (``kv_cache_memory_bytes``, ``VLLM_CPU_KVCACHE_SPACE``)
    and ``--gpu-memory-utilization`` asks more than the engine can use: `cache_bytes_needed`; None otherwise."""
    cache = vllm_config.cache_config
    if cache.kv_cache_memory_bytes is not None or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    needed = cache_bytes_needed(vllm_config)
    return needed if needed < cache.gpu_memory_utilization * host_memory_bytes else None


def cap_cpu_cache(vllm_config) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import psutil

    host = psutil.virtual_memory().total
    cap = cpu_cache_cap(vllm_config, host)
    if cap is None:
        return
    cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
    logger.warning("on a CPU, --gpu-memory-utilization %s would reserve %.1f of the host's %.1f GiB; the cache of %d "
                   "requests of %d tokens (--max-num-seqs, --max-model-len) needs at most %.0f MiB, which this "
                   "FactorEngram model takes instead (--kv-cache-memory-bytes sets it)", cache.gpu_memory_utilization,
                   cache.gpu_memory_utilization * host / 2 ** 30, host / 2 ** 30, scheduler.max_num_seqs,
                   vllm_config.model_config.max_model_len, cap / 2 ** 20)
    cache.kv_cache_memory_bytes = cap


def say_the_served_dtype(model_config) -> None:
    """One line when the folder's weights are served in another dtype (vLLM's --dtype auto serves a float32
    folder in bfloat16); the weights are cast as they load (`FactorEngramForCausalLM.load_weights`)."""
    saved = getattr(model_config.hf_config, "dtype", None) or getattr(model_config.hf_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    if isinstance(saved, torch.dtype) and saved != model_config.dtype:
        logger.warning("this folder's weights are %s and are served in %s (--dtype); --dtype %s serves them as saved",
                    str(saved).removeprefix("torch."), str(model_config.dtype).removeprefix("torch."),
                    str(saved).removeprefix("torch."))


def speculate_without_prefix_caching_on_a_cpu(vllm_config) -> None:
    """vLLM's CPU build cannot verify drafts with prefix caching on for a model with per-request state: its align mode
    then copies each state with a Triton kernel (``precopy_mamba_align_fused_kernel``, vllm/v1/worker/mamba_utils.py)
    that the CPU build does not replace, and the first step stops there. Speculative decoding was asked for by name
    and prefix caching is vLLM's default, so on a CPU the second is turned off, saying so."""
    from vllm.platforms import current_platform

    cache = vllm_config.cache_config
    if current_platform.is_cpu() and vllm_config.speculative_config is not None and cache.enable_prefix_caching:
        logger.warning("prefix caching is off for this run: on a CPU, vLLM %s verifies speculative drafts of a model "
                       "with per-request state only without it (its align mode copies states with a Triton kernel "
                       "that the CPU build lacks); --no-enable-prefix-caching says so yourself", vllm.__version__)
        cache.enable_prefix_caching = False


def plain_without_memory(model_config) -> None:
    """A folder served without memory (a plain Transformer, or ``--hf-overrides '{"memory": null}'``) has no layer
    with per-request state: its layers are all attention (``layer_types``, as vLLM reads a hybrid config whose
    layers are all attention), so vLLM serves it as a plain model (with prefix caching, vLLM's align mode would
    otherwise look for a state to keep and stop at the first step: "no mamba layers in the model"). transformers
    infers the same layer types when the field is absent."""
    config = model_config.hf_config
    if config.memory_config() is None:
        config.layer_types = ["full_attention"] * config.num_hidden_layers


def split_at_memory_ops(compilation_config) -> None:
    """The memory's ops join the ops at which vLLM splits its compiled graph for piecewise CUDA graphs (attention,
    Mamba, short convolutions): a captured graph must not replay one step's requests in another. Where the user set
    no splitting ops, they join vLLM's own list (``CompilationConfig._attention_ops``, which vLLM reads when it
    chooses its defaults, after this hook); splitting ops the user set are extended; an empty list (one whole graph,
    no splitting) is kept as given."""
    ops = compilation_config.splitting_ops
    if ops is None:
        defaults = type(compilation_config)._attention_ops
        defaults.extend(op for op in MEMORY_OPS if op not in defaults)
    elif ops:
        ops.extend(op for op in MEMORY_OPS if op not in ops)


def piecewise_graphs_on_a_gpu(vllm_config) -> None:
    """On a GPU, CUDA graphs only between the memory's ops (``PIECEWISE``): a full graph of a decoding step would
    capture them, and they read each step's requests on the host (the ids' range check, memory-mapped tables), which
    a replay would not repeat. vLLM's default for a model with per-request state is ``FULL_AND_PIECEWISE``; a mode
    with full graphs that the user set is replaced, saying so. On a CPU vLLM captures no graph."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if current_platform.is_cpu() or (mode is not None and not mode.has_full_cudagraphs()):
        return
    if mode is not None:
        logger.warning("cudagraph_mode %s captures the FactorEngram memory's ops in full graphs of a decoding step; "
                       "this model runs PIECEWISE (graphs between them)", mode.name)
    compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE


class FactorEngramServingConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        check_vllm_internals()
        problems = refusals(vllm_config)
        if problems:
            raise ValueError("a FactorEngram model cannot be served with " + "; ".join(problems))
        plain_without_memory(vllm_config.model_config)
        speculate_without_prefix_caching_on_a_cpu(vllm_config)
        split_at_memory_ops(vllm_config.compilation_config)
        piecewise_graphs_on_a_gpu(vllm_config)
        cap_cpu_cache(vllm_config)
        say_the_served_dtype(vllm_config.model_config)
