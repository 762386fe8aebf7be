"""What the served model refuses, by name, and the check of the vLLM internals it reads (no engine started)."""

import types

import pytest

from tests.helpers.serving import SKIP_REASON

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)


def config(pipeline=1, speculative=None, prefix_caching=False):
    return types.SimpleNamespace(parallel_config=types.SimpleNamespace(pipeline_parallel_size=pipeline),
                                 speculative_config=speculative,
                                 cache_config=types.SimpleNamespace(enable_prefix_caching=prefix_caching))


def test_what_cannot_be_served_exactly_is_refused_by_name():
    from fe_megatron.vllm.model import refuse_unsupported

    refuse_unsupported(config())
    with pytest.raises(ValueError, match=r"pipeline parallelism \(pipeline_parallel_size=2\).*speculative decoding"):
        refuse_unsupported(config(pipeline=2, speculative=object()))
    with pytest.raises(ValueError, match="prefix caching: pass --no-enable-prefix-caching"):
        refuse_unsupported(config(prefix_caching=True))


def test_the_serving_config_turns_prefix_caching_off_and_runs_eagerly():
    from fe_megatron.vllm.serving_config import FactorEngramServingConfig

    settings = types.SimpleNamespace(cache_config=types.SimpleNamespace(enable_prefix_caching=True),
                                     model_config=types.SimpleNamespace(enforce_eager=False))
    FactorEngramServingConfig.verify_and_update_config(settings)
    assert settings.cache_config.enable_prefix_caching is False and settings.model_config.enforce_eager is True


def test_a_vllm_without_the_state_contract_is_refused_at_start_up(monkeypatch):
    from fe_megatron.vllm import memory_layer

    memory_layer.check_vllm_internals()  # the installed vLLM has every field the layer reads
    monkeypatch.setattr(memory_layer, "METADATA_FIELDS", (*memory_layer.METADATA_FIELDS, "cache_slots_p"))
    with pytest.raises(RuntimeError, match=r"no longer has \['cache_slots_p'\].*checked with vLLM 0.32"):
        memory_layer.check_vllm_internals()


def test_the_plugin_registers_the_model_and_its_config():
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from fe_megatron.vllm import ARCHITECTURE, register
    from fe_megatron.vllm.serving_config import FactorEngramServingConfig

    from importlib.metadata import entry_points

    assert "fe_megatron.vllm:register" in [plugin.value for plugin in entry_points(group="vllm.general_plugins")]
    register()
    register()  # idempotent
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    assert MODELS_CONFIG_MAP[ARCHITECTURE] is FactorEngramServingConfig
