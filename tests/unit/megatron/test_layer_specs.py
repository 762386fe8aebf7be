"""`fe_megatron.megatron.layer_specs`: the Transformer Engine spec, or the error that names what it needs."""

import pytest

from tests.helpers.configs import tiny_memory_config


def test_te_spec_branch_sees_same_hidden_state():
    pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed (GPU-only)")
    from fe_megatron.megatron import get_gpt_layer_with_factorengram_spec

    spec = get_gpt_layer_with_factorengram_spec(tiny_memory_config(), backend="te")
    assert spec.params["memory_config"].layers == [1, 2]


def test_te_backend_without_te_names_the_problem():
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine is installed")
    except ImportError:
        pass
    from fe_megatron.megatron import get_gpt_layer_with_factorengram_spec

    with pytest.raises(ImportError, match="backend='te' needs Transformer Engine"):
        get_gpt_layer_with_factorengram_spec(tiny_memory_config(), backend="te")
