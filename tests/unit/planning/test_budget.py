"""Parameter budgets (`fe_megatron.planning.budget`): the paper's Table 8 totals, the 340M preset's scale,
counts equal to the instantiated modules, and the tables in every storage format."""

import pytest

from fe_megatron.config import MemoryConfig
from fe_megatron.memory import build_memory
from fe_megatron.planning.budget import backbone_params, memory_layer_budget, total_params
from tests.helpers.configs import small_config


@pytest.mark.parametrize("preset, paper_total", [("factorengram-340m", 1.4e9), ("factorengram-1b", 3.9e9)])
def test_table8_totals_within_ten_percent(preset, paper_total):
    total = total_params(MemoryConfig.from_preset(preset))
    assert abs(total - paper_total) / paper_total < 0.10, total


def test_340m_backbone_and_tables_match_paper_scale():
    c = MemoryConfig.from_preset("factorengram-340m")
    assert abs(backbone_params(c) - 340e6) / 340e6 < 0.05
    tables = sum(memory_layer_budget(c, layer).tables for layer in c.layers)
    assert abs(tables - 1.1e9) / 1.1e9 < 0.05


@pytest.mark.parametrize("overrides", [
    {}, dict(gate="scalar"), dict(gate="none"), dict(placement="inside_ffn"),
    dict(kind="engram", gate="scalar", memory_dim=24), dict(kind="engram", gate="none", memory_dim=24),
    dict(ngram_orders=[2, 3], table_capacity=[211, 307], coeff_width=16),
])
def test_budget_counts_equal_instantiated_modules(overrides):
    c = small_config(**overrides)
    for layer in c.layers:
        module = build_memory(c, layer)
        assert memory_layer_budget(c, layer).total == sum(p.numel() for p in module.parameters())


def test_fe_plan_counts_the_tables_in_every_storage_format():
    from fe_megatron.planning.budget import format_budget, memory_layer_budget, serving_table_bytes

    config = small_config()
    tables = sum(memory_layer_budget(config, layer).tables for layer in config.layers)
    stored = serving_table_bytes(config)
    assert stored == {"fp32": 4 * tables, "bf16": 2 * tables, "fp8": tables + 4 * tables // config.branch_width}
    line = [text for text in format_budget(config).splitlines() if text.startswith("tables stored for serving")]
    assert line and "fp32 " in line[0] and "| bf16 " in line[0] and "| fp8 " in line[0]
