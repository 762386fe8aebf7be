"""What the served model refuses, by name, before any engine process starts; which of vLLM's defaults it keeps; how the step's
requests are read from vLLM's metadata; and the check of the vLLM internals it reads. Each configuration here
is vLLM's own (`EngineArgs.create_engine_config` over a converted folder), built without starting an engine."""

import pytest
import torch

from tests.helpers.serving import require_vllm, save_tiny_model

vllm = require_vllm()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("served") / "model"
    save_tiny_model(directory)
    return str(directory)


def engine_config(folder, **arguments):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                      **arguments).create_engine_config()


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def test_vllm_s_defaults_are_kept(folder):
    """Compiled, prefix caching on (in vLLM's align mode, which keeps the memory's look-back at block boundaries),
    and the memory's ops among those vLLM splits its compiled graph at."""
    from vllm.config import CompilationMode

    from fe_megatron.vllm.memory_layer import MEMORY_OPS

    config = engine_config(folder)
    assert config.model_config.enforce_eager is False
    assert config.compilation_config.mode != CompilationMode.NONE
    assert config.cache_config.enable_prefix_caching is True and config.cache_config.mamba_cache_mode == "align"
    # the ops vLLM splits its graphs at when it chooses them (on a GPU; a CPU captures no graph and splits none)
    assert set(MEMORY_OPS) <= set(type(config.compilation_config)._attention_ops)


@pytest.mark.parametrize("asked, served", [(None, "PIECEWISE"), ("FULL_AND_PIECEWISE", "PIECEWISE"),
                                           ("FULL", "PIECEWISE"), ("PIECEWISE", "PIECEWISE"), ("NONE", "NONE")])
def test_on_a_gpu_cuda_graphs_are_piecewise_between_the_memory_ops(monkeypatch, asked, served):
    """A full graph of a decoding step would capture the memory's ops, which read each step's requests on the host;
    on a CPU no graph is captured, and nothing changes."""
    import types

    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    from fe_megatron.vllm.serving_config import piecewise_graphs_on_a_gpu

    def config():
        compilation = types.SimpleNamespace(cudagraph_mode=None if asked is None else CUDAGraphMode[asked])
        return types.SimpleNamespace(compilation_config=compilation)

    on_a_cpu = config()
    piecewise_graphs_on_a_gpu(on_a_cpu)
    assert on_a_cpu.compilation_config.cudagraph_mode == (None if asked is None else CUDAGraphMode[asked])
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda *args: False)
    on_a_gpu = config()
    piecewise_graphs_on_a_gpu(on_a_gpu)
    assert on_a_gpu.compilation_config.cudagraph_mode == CUDAGraphMode[served]


def test_a_folder_served_without_memory_is_a_plain_model(folder):
    """No layer keeps a state, so vLLM must not look for one (its align mode stopped at the first step: "no mamba
    layers in the model"); prefix caching stays on."""
    config = engine_config(folder, hf_overrides={"memory": None})
    assert config.model_config.is_hybrid is False and config.cache_config.enable_prefix_caching is True
    assert engine_config(folder).model_config.is_hybrid is True


def test_on_a_cpu_speculative_decoding_turns_prefix_caching_off(folder):
    config = engine_config(folder, speculative_config=NGRAM)
    assert config.speculative_config is not None and config.num_speculative_tokens == 2
    assert config.cache_config.enable_prefix_caching is False and config.cache_config.mamba_cache_mode == "none"


@pytest.mark.parametrize("arguments, named", [
    (dict(enable_prompt_embeds=True), r"prompts as embeddings \(--enable-prompt-embeds\)"),
    (dict(hf_overrides={"table_storage": "mmaped"}), r"table_storage='mmaped': use one of \['memory', 'mmap'\]"),
], ids=["prompt-embeds", "table-storage"])
def test_what_cannot_be_served_exactly_is_refused_by_name(folder, arguments, named):
    with pytest.raises(ValueError, match="a FactorEngram model cannot be served with " + named):
        engine_config(folder, **arguments)


def test_on_a_cpu_the_cache_is_what_the_requests_can_fill(folder):
    """vLLM's CPU backend reserves --gpu-memory-utilization (0.92 by default) of the host's memory; the plugin gives
    the cache what max_num_seqs requests of max_model_len tokens can fill instead, unless the user sized it or asked
    for less."""
    from fe_megatron.vllm.serving_config import CACHE_MARGIN_BYTES

    config = engine_config(folder)
    assert config.cache_config.gpu_memory_utilization == 0.92
    assert CACHE_MARGIN_BYTES < config.cache_config.kv_cache_memory_bytes < 256 * 2 ** 20
    assert engine_config(folder, kv_cache_memory_bytes=2 ** 30).cache_config.kv_cache_memory_bytes == 2 ** 30
    assert engine_config(folder, gpu_memory_utilization=1e-4).cache_config.kv_cache_memory_bytes is None


def test_a_kv_connector_is_refused_by_name(folder):
    """A connector needs a peer to build; the check reads only whether one is configured."""
    from fe_megatron.vllm.serving_config import refusals

    config = engine_config(folder)
    assert refusals(config) == []
    config.kv_transfer_config = object()  # any connector: its keys and values come from elsewhere
    assert [problem for problem in refusals(config) if problem.startswith("a KV connector (--kv-transfer-config)")]


def metadata(num_decodes, prefill_lengths=(), has_initial=(), decode_slots_2d=False, decode_lengths=None,
             accepted=None):
    """vLLM's short-convolution metadata of a step: decodes first (slots 10, 11, ..; with ``decode_lengths``, each a
    token and its drafts, ``accepted`` of the last step's), then prefills (slots 20, ..)."""
    from vllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata

    def offsets(lengths):
        return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int32).cumsum(0).tolist()], dtype=torch.int32)

    decode_slots = torch.arange(10, 10 + num_decodes, dtype=torch.int32)
    num_prefills = len(prefill_lengths)
    return ShortConvAttentionMetadata(
        num_prefills=num_prefills, num_prefill_tokens=int(sum(prefill_lengths)), num_decodes=num_decodes,
        num_decode_tokens=int(sum(decode_lengths)) if decode_lengths else num_decodes,
        num_reqs=num_decodes + num_prefills,
        has_initial_states_p=torch.tensor(has_initial, dtype=torch.bool) if num_prefills else None,
        query_start_loc_p=offsets(prefill_lengths) if num_prefills else None,
        state_indices_tensor_p=torch.arange(20, 20 + num_prefills, dtype=torch.int32) if num_prefills else None,
        state_indices_tensor_d=decode_slots.unsqueeze(1).repeat(1, 3) if decode_slots_2d else decode_slots,
        query_start_loc_d=offsets(decode_lengths) if decode_lengths else None,
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32) if accepted else None,
        seq_lens=torch.zeros(num_decodes + num_prefills))


@pytest.mark.parametrize("decode_slots_2d", [False, True])
def test_the_step_s_requests_are_read_from_vllm_s_metadata(decode_slots_2d):
    from fe_megatron.vllm.memory_layer import request_batch

    cpu = torch.device("cpu")
    decodes = request_batch(metadata(3, decode_slots_2d=decode_slots_2d), cpu)
    assert decodes.uniform == 1 and decodes.num_tokens == 3 and decodes.slots.tolist() == [10, 11, 12]
    mixed = request_batch(metadata(2, (5, 1, 7), (True, False, False), decode_slots_2d), cpu)
    assert mixed.uniform is None and mixed.num_tokens == 15 and mixed.speculative is None
    assert mixed.lengths.tolist() == [1, 1, 5, 1, 7] and mixed.slots.tolist() == [10, 11, 20, 21, 22]
    assert mixed.has_history.tolist() == [True, True, True, False, False]
    prefills = request_batch(metadata(0, (4,), (False,)), cpu)
    assert prefills.lengths.tolist() == [4] and prefills.slots.tolist() == [20] and prefills.uniform is None
    # speculative decoding: decodes of a token and its drafts, read at the last step's accepted draft
    drafts = request_batch(metadata(3, (6,), (True,), decode_slots_2d, decode_lengths=(3, 1, 2), accepted=(2, 1, 3)),
                           cpu)
    assert drafts.lengths.tolist() == [3, 1, 2, 6] and drafts.num_tokens == 12
    assert drafts.slots.tolist() == [10, 11, 12, 20] and drafts.read_from.tolist() == [1, 0, 2, 0]
    assert drafts.speculative.tolist() == [True, True, True, False]


def test_a_vllm_without_the_state_contract_is_refused_at_start_up(monkeypatch):
    from fe_megatron.vllm import memory_layer

    memory_layer.check_vllm_internals()  # the installed vLLM has every field the layer reads
    monkeypatch.setattr(memory_layer, "METADATA_FIELDS", (*memory_layer.METADATA_FIELDS, "cache_slots_p"))
    with pytest.raises(RuntimeError, match=r"no longer has \['cache_slots_p'\].*checked with vLLM 0.32"):
        memory_layer.check_vllm_internals()


def test_the_plugin_registers_the_model_and_its_config():
    from importlib.metadata import entry_points

    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from fe_megatron.vllm import ARCHITECTURE, register
    from fe_megatron.vllm.serving_config import FactorEngramServingConfig

    assert "fe_megatron.vllm:register" in [plugin.value for plugin in entry_points(group="vllm.general_plugins")]
    register()
    register()  # idempotent
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    assert MODELS_CONFIG_MAP[ARCHITECTURE] is FactorEngramServingConfig
