"""`fe_megatron.megatron.memory_layer`: the Megatron layers refuse a serving format."""

import pytest

from tests.helpers.configs import small_config


def test_the_megatron_layers_refuse_a_serving_format():
    """Building the layers directly (Megatron-LM's own scripts), not through fe-pretrain's config."""
    from fe_megatron.megatron.memory_layer import build_memory_branch

    with pytest.raises(ValueError, match="table_dtype='fp8' is a serving format .*the Megatron layers train fp32"):
        build_memory_branch(None, small_config(table_dtype="fp8"), 1)
