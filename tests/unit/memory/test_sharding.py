"""`fe_megatron.memory.sharding`: the plan has an entry for every parameter, and pipeline stages follow
Megatron's even split."""

import pytest

from fe_megatron.memory import build_memory
from tests.helpers.configs import small_config


@pytest.mark.parametrize("overrides", [
    dict(), dict(gate="scalar"), dict(gate="none"), dict(placement="inside_ffn"),
    dict(kind="engram", gate="scalar", memory_dim=24), dict(kind="engram", gate="none", memory_dim=24),
    dict(gate="scalar", table_dtype="fp8"), dict(kind="engram", gate="scalar", memory_dim=24, table_dtype="fp8")])
def test_sharding_plan_has_an_entry_for_every_parameter(overrides):
    """Adding a parameter without saying how the layouts split it fails here."""
    from fe_megatron.memory.sharding import SHARDING_PLAN, local_shape

    cfg = small_config(**overrides)
    module = build_memory(cfg, 1)
    plan = SHARDING_PLAN[cfg.kind]
    assert set(dict(module.named_parameters())) <= set(plan)
    if cfg.gate == "scalar" and cfg.table_dtype == "fp8":  # the variant with every parameter (fp8: row scales)
        assert set(dict(module.named_parameters())) == set(plan)
    for name, param in module.named_parameters():
        assert module.global_shape(name) == tuple(param.shape)  # one process holds the global shapes
        dim = plan[name].tensor_parallel_dim
        expected = list(param.shape)
        if dim is not None:
            expected[dim] //= 2
        assert local_shape(cfg.kind, name, tuple(param.shape), 2) == tuple(expected)


def test_stages_without_memory_follow_megatrons_even_split():
    from fe_megatron.memory.sharding import pipeline_stage_layers, stages_without_memory

    assert [list(pipeline_stage_layers(24, 4, stage)) for stage in (0, 3)] == [list(range(6)), list(range(18, 24))]
    assert stages_without_memory([10, 12], 24, 4) == [0, 3]  # the paper's layers
    assert stages_without_memory([3, 5], 24, 2) == [1] and stages_without_memory([10, 12], 24, 2) == []
