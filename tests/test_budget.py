import os
import subprocess
import sys

import pytest

from fe_megatron.planning.budget import backbone_params, memory_layer_budget, total_params
from fe_megatron.config import MemoryConfig
from fe_megatron.memory import build_memory
from fe_megatron.planning.rank_memory import DTYPE_BYTES
from tests.helpers.configs import small_config
from tests.helpers.paths import ROOT


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
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "fe_megatron.planning.cli"]
    out = subprocess.run(cmd + ["--preset", "factorengram-340m"], capture_output=True, text=True, check=True).stdout
    last = out.strip().splitlines()[-1]
    assert last == f"total_params={total_params(MemoryConfig.from_preset('factorengram-340m'))}"
    assert "backbone_params=" in out and "tables order 2" in out and "dictionary" in out
    bad = subprocess.run(cmd + ["--preset", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown memory preset 'nope'" in bad.stderr


def test_rank_memory_of_whole_and_row_sharded_tables():
    from fe_megatron.planning.rank_memory import exchange_bytes_per_step, rank_memory

    c = MemoryConfig.from_preset("factorengram-340m")
    tables = sum(memory_layer_budget(c, layer).tables for layer in c.layers)
    # fp32 runs: the engine's optimizer holds fp32 tables, and its distributed optimizer splits whole tables' moments
    whole = rank_memory(c, dp=8, table_sharding="replicated", distributed_optimizer=True, precision="fp32")
    rows = rank_memory(c, dp=8, table_sharding="rows", distributed_optimizer=True, precision="fp32")
    assert whole.table_weights == whole.table_grads == 4 * tables and whole.table_optimizer == 8 * tables / 8
    assert rows.table_weights == rows.table_grads == 4 * tables / 8 and rows.table_optimizer == 8 * tables / 8
    assert rows.rest == whole.rest and rank_memory(c, tp=2).table_weights == 2 * tables
    # bf16 runs train every table from stores, whose moments the distributed optimizer does not split; so
    # do layouts with a pipeline stage holding no memory layer (at PP=4 stages 1 and 2 hold one of the two
    # layers each, stages 0 and 3 none)
    assert rank_memory(c, dp=8, distributed_optimizer=True, precision="bf16").table_optimizer == 8 * tables
    heaviest_layer = max(memory_layer_budget(c, layer).tables for layer in c.layers)  # primes differ per layer
    assert rank_memory(c, pp=4, dp=8, distributed_optimizer=True, precision="fp32").table_optimizer == \
        8 * heaviest_layer
    # 64 sequences over 8 ranks: 8 microbatches x 2 layers x 8192 x 12 positions, 7/8 of them elsewhere
    assert exchange_bytes_per_step(c, 1, 1, 8, 1, 8192, 64) == 8 * 2 * 8192 * 12 * 7 / 8 * (8 + 8 * 256)
    assert exchange_bytes_per_step(c, 1, 1, 1, 1, 8192, 64) == 0


def test_stages_without_memory_follow_megatrons_even_split():
    from fe_megatron.memory.sharding import pipeline_stage_layers, stages_without_memory

    assert [list(pipeline_stage_layers(24, 4, stage)) for stage in (0, 3)] == [list(range(6)), list(range(18, 24))]
    assert stages_without_memory([10, 12], 24, 4) == [0, 3]  # the paper's layers
    assert stages_without_memory([3, 5], 24, 2) == [1] and stages_without_memory([10, 12], 24, 2) == []


def test_the_heaviest_stage_is_counted_in_the_tables_storage():
    """With the tables in host memory a stage's device bytes are its other weights; the stage
    reported is the one holding the most bytes in all, which at PP=4 is a stage with a memory layer."""
    from fe_megatron.planning.rank_memory import TableStorage, rank_memory

    c = MemoryConfig.from_preset("factorengram-340m")
    heaviest_layer = max(memory_layer_budget(c, layer).tables for layer in c.layers)
    for storage in (TableStorage(), TableStorage("bf16", "bf16", "host")):
        m = rank_memory(c, pp=4, dp=8, precision="fp32", storage=storage)
        assert m.table_weights == DTYPE_BYTES[storage.table_dtype] * heaviest_layer
        assert m.host == (m.tables if storage.placement == "host" else 0)


@pytest.mark.parametrize("table_dtype,state_dtype,placement,per_parameter", [
    ("fp32", "fp32", "device", 16), ("bf16", "fp32", "device", 14), ("bf16", "bf16", "device", 8),
    ("fp32", "fp32", "host", 16), ("bf16", "bf16", "host", 8)])
def test_each_table_storage_costs_its_bytes_where_it_lives(table_dtype, state_dtype, placement, per_parameter):
    from fe_megatron.planning.rank_memory import TableStorage, rank_memory

    c = MemoryConfig.from_preset("factorengram-340m")
    tables = sum(memory_layer_budget(c, layer).tables for layer in c.layers)
    m = rank_memory(c, tp=2, dp=8, table_sharding="rows", storage=TableStorage(table_dtype, state_dtype, placement))
    assert m.tables == per_parameter * tables / 2 / 8
    assert (m.host, m.device) == ((m.tables, m.rest) if placement == "host" else (0, m.tables + m.rest))


def test_table_storage_choices_count_every_way_of_keeping_the_tables():
    from fe_megatron.planning.rank_memory import table_storage_choices

    c = MemoryConfig.from_preset("factorengram-340m")
    tables = sum(memory_layer_budget(c, layer).tables for layer in c.layers)
    rows = tables / c.branch_width  # at TP=2 each rank holds half of every row, and each row's fp8 scale
    got = {(x.use, x.table_dtype, x.state_dtype, x.placement, x.update, x.sharding): x.tables
           for x in table_storage_choices(c, 2, 1, 8, "bf16")}
    rowwise = 2 + 4 / (c.branch_width / 2)  # bf16 rows, no dense gradient, one fp32 state per (half) row
    train = {tuple(key): per_parameter * tables / 2 for *key, per_parameter in (
        ("fp32", "fp32", "device", "adamw", 16), ("bf16", "fp32", "device", "adamw", 14),
        ("bf16", "bf16", "device", "adamw", 8), ("fp32", "fp32", "host", "adamw", 16),
        ("bf16", "bf16", "host", "adamw", 8), ("bf16", "fp32", "device", "rowwise_adagrad", rowwise),
        ("bf16", "fp32", "host", "rowwise_adagrad", rowwise))}
    expected = {("train", *key, "whole"): value for key, value in train.items()}
    expected.update({("train", *key, "rows"): value / 8 for key, value in train.items()})
    expected.update({("serve", "fp32", "-", "device", "-", "whole"): 4 * tables / 2,
                     ("serve", "bf16", "-", "device", "-", "whole"): 2 * tables / 2,
                     ("serve", "fp8", "-", "device", "-", "whole"): tables / 2 + 4 * rows})
    assert got == expected


def test_fe_plan_at_the_engram_papers_table_scale_shows_where_each_choice_stops_fitting():
    """38.5B table parameters at DP=8: with AdamW only row-sharded tables train, and of those fp32
    and bf16 tables with fp32 state only from the host, and whole tables do not fit even the host
    tier's node; row-wise AdaGrad (no dense gradient, 4 bytes of state per row) trains whole bf16
    tables from the host and row-sharded ones on the device."""
    exe = os.path.join(os.path.dirname(sys.executable), "fe-plan")
    config = os.path.join(ROOT, "examples", "plan",
                          "engram_scale.yaml")
    out = subprocess.run([exe, "--config", config, "--dp", "8", "--table-sharding", "rows"], capture_output=True,
                         text=True, check=True).stdout
    assert "total_params=39841994368" in out  # 38.5B of them in the tables
    fits = {" ".join(line.split()[:6]): line.split()[-1] for line in out.splitlines()
            if line.startswith(("train ", "serve "))}
    assert fits == {"train fp32 fp32 device adamw whole": "no", "train bf16 fp32 device adamw whole": "no",
                    "train bf16 bf16 device adamw whole": "no", "train fp32 fp32 host adamw whole": "no",
                    "train bf16 bf16 host adamw whole": "no",
                    "train bf16 fp32 device rowwise_adagrad whole": "no",
                    "train bf16 fp32 host rowwise_adagrad whole": "yes",
                    "train fp32 fp32 device adamw rows/8": "no", "train bf16 fp32 device adamw rows/8": "no",
                    "train bf16 bf16 device adamw rows/8": "yes", "train fp32 fp32 host adamw rows/8": "yes",
                    "train bf16 bf16 host adamw rows/8": "yes",
                    "train bf16 fp32 device rowwise_adagrad rows/8": "yes",
                    "train bf16 fp32 host rowwise_adagrad rows/8": "yes",
                    "serve fp32 - device - whole": "no", "serve bf16 - device - whole": "yes",
                    "serve fp8 - device - whole": "yes"}


def test_fe_plan_prints_per_rank_memory_and_refuses_a_bad_layout():
    exe = os.path.join(os.path.dirname(sys.executable), "fe-plan")
    base = [exe, "--preset", "factorengram-340m", "--dp", "8", "--distributed-optimizer"]
    rows = subprocess.run(base + ["--table-sharding", "rows"], capture_output=True, text=True, check=True).stdout
    whole = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    assert "tables rows" in rows and "row exchange per step and rank: at most 2.64 GiB" in rows
    assert "tables        0.51      0.51       1.01      2.03" in rows
    # bf16 (the default): the tables train from stores, whose moments the distributed optimizer does not split
    assert "tables        4.06      4.06       8.12     16.24" in whole and "row exchange" not in whole
    assert "the tables' Adam moments are not split over DP: the tables train from stores (a bf16 run)" in whole
    host = subprocess.run(base + ["--table-sharding", "rows", "--table-dtype", "bf16", "--table-state-dtype", "bf16",
                                  "--table-placement", "host"], capture_output=True, text=True, check=True).stdout
    assert "tables bf16 weights, bf16 gradients and Adam moments (8 bytes per parameter), in host memory" in host
    assert "tables        0.25      0.25       0.51      1.01  (host)" in host
    sparse = subprocess.run(base + ["--table-sharding", "rows", "--table-dtype", "bf16", "--table-update",
                                    "rowwise_adagrad"], capture_output=True, text=True, check=True).stdout
    assert "gradients of the touched rows only, rowwise_adagrad's one fp32 state per row (2.01562 bytes per " \
           "parameter)" in sparse  # bf16 rows and 4 bytes per row of s_b = 256
    assert "tables        0.25      0.00       0.00      0.26" in sparse
    assert rows.strip().splitlines()[-1].startswith("total_params=")
    bad = subprocess.run(base + ["--micro-batch-size", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "global batch 64 (default) is not a multiple of micro-batch x DP = 3 x 8" in bad.stderr


PAPER_CONFIG = os.path.join(ROOT, "examples", "configs",
                            "paper_340m_factorengram.yaml")


def fe_plan(*args) -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "fe-plan")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "fe_megatron.planning.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, check=True).stdout


def test_fe_plan_takes_the_training_configs_layout_and_storage_and_flags_override_it():
    """The paper config asks for row-sharded tables and the distributed optimizer: --config alone must
    plan that (about 5 GB per rank at DP=8), and say where every setting came from."""
    import re

    planned = fe_plan("--config", PAPER_CONFIG, "--dp", "8")
    assert "tables rows" in planned and "distributed optimizer" in planned
    assert "table_sharding=rows (config parallel.table_sharding)" in planned and "dp=8 (--dp)" in planned
    assert "precision=bf16 (config training.precision)" in planned
    assert int(re.search(r"rank_bytes=(\d+)", planned).group(1)) < 5.5e9
    overridden = fe_plan("--config", PAPER_CONFIG, "--dp", "8", "--table-sharding", "replicated",
                         "--no-distributed-optimizer")
    assert "table_sharding=replicated (--table-sharding)" in overridden
    assert "distributed_optimizer=no (--distributed-optimizer)" in overridden
    assert int(re.search(r"rank_bytes=(\d+)", overridden).group(1)) > 2.4e10


def test_fe_plan_plans_a_training_config_whose_data_is_still_to_be_set(tmp_path):
    """fe-convert's placeholder train.yaml has no data.train_data yet; fe-plan reads no data."""
    import yaml

    config = yaml.safe_load(open(PAPER_CONFIG))
    config["data"].pop("train_data")
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    assert "table_sharding=rows (config parallel.table_sharding)" in fe_plan("--config", str(path), "--dp", "8")


def test_fe_plan_estimates_activations_the_checkpoint_on_disk_and_gradient_traffic():
    planned = fe_plan("--config", PAPER_CONFIG, "--dp", "8")
    assert "activations per rank: about " in planned and "fused attention" in planned
    assert "checkpoint on disk: 17.04 GiB each; 494.1 GiB for all 29 the run writes" in planned
    assert "data-parallel gradient traffic per step and rank:" in planned
    assert "heaviest pipeline stage" not in planned  # PP=1 has one stage
    kept = fe_plan("--config", PAPER_CONFIG, "--dp", "8", "--keep-checkpoints", "3")
    assert "51.1 GiB for the 3 kept (training.keep_checkpoints)" in kept
    assert "heaviest pipeline stage" in fe_plan("--config", PAPER_CONFIG, "--dp", "4", "--pp", "2")


def test_activation_estimate_follows_recompute_precision_and_tensor_parallelism():
    from fe_megatron.config import MemoryConfig
    from fe_megatron.planning.run_estimates import activation_bytes

    config = MemoryConfig.from_preset("factorengram-340m")
    base = dict(tp=1, pp=1, micro_batch_size=1, seq_length=4096, precision="bf16", recompute="none", microbatches=8)
    full = activation_bytes(config, **base)
    s, h, layers = 4096, config.hidden_size, config.num_layers
    logits = 4 * s * config.vocab_size
    assert activation_bytes(config, **base, fused_attention=True) == pytest.approx(
        layers * s * h * 34 + 2 * s * (3 * config.coeff_width + 2 * config.memory_dim + 3 * h) * 2 + logits)
    assert activation_bytes(config, **{**base, "recompute": "full"}) < full / 5
    assert activation_bytes(config, **{**base, "precision": "fp32"}) - logits == pytest.approx(2 * (full - logits))
    tp2 = activation_bytes(config, **{**base, "tp": 2}, sequence_parallel=True, fused_attention=True)
    assert tp2 < activation_bytes(config, **base, fused_attention=True) / 1.9


def test_fe_plan_counts_an_moe_backbone_s_experts_and_makes_no_per_rank_estimate_for_it(tmp_path, capsys):
    from fe_megatron.planning.budget import layer_params
    from fe_megatron.planning.cli import main

    dense, moe = (MemoryConfig.from_dict({"preset": "factorengram-tiny"}, backbone={"preset": "tiny", "num_experts": n})
                  for n in (0, 4))
    d, f = moe.hidden_size, moe.ffn_hidden_size
    assert layer_params(moe) - layer_params(dense) == 3 * 3 * d * f + 4 * d  # three more experts and the router
    path = tmp_path / "moe.yaml"
    path.write_text("model:\n  preset: tiny\n  num_experts: 4\nmemory:\n  preset: factorengram-tiny\n"
                    "data:\n  tokenizer_model: t.model\n  train_data: [corpus]\n")
    assert main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "per-rank estimates: not made for an MoE backbone (model.num_experts=4" in out
    assert out.strip().splitlines()[-1] == f"total_params={total_params(moe)}"
