import os
import subprocess
import sys

import pytest

from fe_megatron.budget import backbone_params, memory_layer_budget, total_params
from fe_megatron.config import MemoryConfig
from fe_megatron.memory import build_memory
from tests.conftest import small_config


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


def test_fe_plan_cli_prints_total_last():
    exe = os.path.join(os.path.dirname(sys.executable), "fe-plan")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "fe_megatron.plan"]
    out = subprocess.run(cmd + ["--preset", "factorengram-340m"], capture_output=True, text=True, check=True).stdout
    last = out.strip().splitlines()[-1]
    assert last == f"total_params={total_params(MemoryConfig.from_preset('factorengram-340m'))}"
    assert "backbone_params=" in out and "tables order 2" in out and "dictionary" in out
    bad = subprocess.run(cmd + ["--preset", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown memory preset 'nope'" in bad.stderr
