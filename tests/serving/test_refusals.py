"""What the served model refuses, by name, before any engine process starts; what it turns off; how the step's
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


def test_prefix_caching_is_turned_off_and_the_model_runs_eagerly(folder):
    config = engine_config(folder, enable_prefix_caching=True)
    assert config.cache_config.enable_prefix_caching is False
    assert config.model_config.enforce_eager is True


@pytest.mark.parametrize("arguments, named", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                              "prompt_lookup_min": 2}), "speculative decoding: .* serve without --speculative-config"),
    (dict(enable_prompt_embeds=True), r"prompts as embeddings \(--enable-prompt-embeds\)"),
    (dict(hf_overrides={"table_storage": "mmaped"}), r"table_storage='mmaped': use one of \['memory', 'mmap'\]"),
], ids=["speculative", "prompt-embeds", "table-storage"])
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


def metadata(num_decodes, prefill_lengths=(), has_initial=(), decode_slots_2d=False):
    """vLLM's short-convolution metadata of a step: decodes first (slots 10, 11, ..), then prefills (slots 20, ..)."""
    from vllm.v1.attention.backends.short_conv_attn import ShortConvAttentionMetadata

    decode_slots = torch.arange(10, 10 + num_decodes, dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(prefill_lengths, dtype=torch.int32).cumsum(0).tolist()],
                          dtype=torch.int32)
    num_prefills = len(prefill_lengths)
    return ShortConvAttentionMetadata(
        num_prefills=num_prefills, num_prefill_tokens=int(sum(prefill_lengths)), num_decodes=num_decodes,
        num_decode_tokens=num_decodes, num_reqs=num_decodes + num_prefills,
        has_initial_states_p=torch.tensor(has_initial, dtype=torch.bool) if num_prefills else None,
        query_start_loc_p=starts if num_prefills else None,
        state_indices_tensor_p=torch.arange(20, 20 + num_prefills, dtype=torch.int32) if num_prefills else None,
        state_indices_tensor_d=decode_slots.unsqueeze(1) if decode_slots_2d else decode_slots,
        query_start_loc_d=None, num_accepted_tokens=None, seq_lens=torch.zeros(num_decodes + num_prefills))


@pytest.mark.parametrize("decode_slots_2d", [False, True])
def test_the_step_s_requests_are_read_from_vllm_s_metadata(decode_slots_2d):
    from fe_megatron.vllm.memory_layer import _request_batch

    decodes = _request_batch(metadata(3, decode_slots_2d=decode_slots_2d), torch.device("cpu"))
    assert decodes.decoding and decodes.num_tokens == 3 and decodes.slots.tolist() == [10, 11, 12]
    mixed = _request_batch(metadata(2, (5, 1, 7), (True, False, False), decode_slots_2d), torch.device("cpu"))
    assert not mixed.decoding and mixed.num_tokens == 15
    assert mixed.lengths.tolist() == [1, 1, 5, 1, 7] and mixed.slots.tolist() == [10, 11, 20, 21, 22]
    assert mixed.has_history.tolist() == [True, True, True, False, False]
    prefills = _request_batch(metadata(0, (4,), (False,)), torch.device("cpu"))
    assert prefills.lengths.tolist() == [4] and prefills.slots.tolist() == [20] and not prefills.decoding


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
