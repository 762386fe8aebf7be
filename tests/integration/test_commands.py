"""The installed commands as a user runs them, each in a process of its own: every console script's
--help reads as plain text; fe-plan's budgets, per-rank memory and the layout a training config asks for;
fe-data without third-party noise; fe-convert graft's presets; what fe-demo and fe-pretrain refuse, and
fe-pretrain's overrides and --check. The commands' code in the test process is tests/unit/'s."""

import json
import os
import subprocess
import sys

import pytest

from fe_megatron.config import MemoryConfig
from fe_megatron.planning.budget import total_params
from tests.helpers.commands import command, run
from tests.helpers.paths import ROOT
from tests.helpers.training import CONFIG


# ----------------------------------------------------------------------------- --help
@pytest.mark.parametrize("name, expected", [
    ("fe-pretrain", ["Pretrain a FactorEngram, Engram or plain Transformer GPT",
                     "  torchrun --nproc_per_node 8 -m fe_megatron.train \\\n"
                     "      --config examples/configs/paper_340m_factorengram.yaml --save checkpoints/run1"]),
    ("fe-plan", ["Print the parameter budget of a memory preset or a YAML config"]),
    ("fe-data", ["Prepare pretraining data: train a sentencepiece tokenizer",
                 "pip install 'fe_megatron[hf]'"]),
    ("fe-demo", ["Pretrain a small FactorEngram model and the same-size Transformer"]),
    ("fe-convert", ["fe-convert: Megatron checkpoints to Hugging Face and back"]),
    ("fe-eval", ["fe-eval: evaluate a trained model"]),
    ("fe-inspect", ["fe-inspect: what the memory of a trained model does on a text",
                    "which checkpoint of a run directory", "read the text's first tokens up to about this many"]),
])
def test_help_texts_read_as_plain_text(name, expected):
    out = run(command(name) + ["--help"]).stdout
    for text in expected:
        assert text in out
    assert "``" not in out  # no reStructuredText quoting leaks into --help


# ----------------------------------------------------------------------------- fe-plan
def test_fe_plan_cli_prints_total_last():
    exe = os.path.join(os.path.dirname(sys.executable), "fe-plan")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "fe_megatron.planning.cli"]
    out = subprocess.run(cmd + ["--preset", "factorengram-340m"], capture_output=True, text=True, check=True).stdout
    last = out.strip().splitlines()[-1]
    assert last == f"total_params={total_params(MemoryConfig.from_preset('factorengram-340m'))}"
    assert "backbone_params=" in out and "tables order 2" in out and "dictionary" in out
    bad = subprocess.run(cmd + ["--preset", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown memory preset 'nope'" in bad.stderr


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


def test_fe_plan_says_which_dtype_it_counts_in():
    out = run(command("fe-plan") + ["--preset", "factorengram-tiny", "--dp", "2"]).stdout
    assert "# counted in: tables fp32 weights, fp32 gradients and Adam moments (16 bytes per parameter), in device " \
           "memory; rest bf16 weights, fp32 gradients and Adam state" in out
    out = run(command("fe-plan") + ["--preset", "factorengram-tiny", "--dp", "2", "--table-dtype", "bf16"]).stdout
    assert "# counted in: tables bf16 weights, fp32 gradients and Adam moments (14 bytes per parameter)" in out


# ----------------------------------------------------------------------------- fe-data
def test_fe_data_prints_no_third_party_warnings(small_data, tmp_path):
    proc = run(command("fe-data") + ["preprocess", "--input", small_data["subset"], "--tokenizer-model",
                                      small_data["tokenizer"], "--output-prefix", str(tmp_path / "x"),
                                      "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- fe-convert
def test_graft_lists_the_memory_presets():
    from fe_megatron.presets import PRESETS

    proc = run(command("fe-convert") + ["graft", "--help"])
    assert "--list-presets" not in proc.stdout and "factorengram-tiny" in proc.stdout
    proc = run(command("fe-convert") + ["graft", "--base", "x", "--memory-preset", "nope", "--output", "y"])
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr and sorted(PRESETS)[0] in proc.stderr


# ----------------------------------------------------------------------------- fe-demo
def test_fe_demo_refuses_zero_steps():
    proc = run(command("fe-demo") + ["--steps", "0"])
    assert proc.returncode == 2 and "argument --steps: 0 is not a positive number of steps" in proc.stderr


# ----------------------------------------------------------------------------- fe-pretrain
def test_fe_pretrain_without_arguments_asks_for_the_config():
    proc = run(command("fe-pretrain"))
    assert proc.returncode == 2
    assert "the following arguments are required: --config" in proc.stderr and "memory" not in proc.stderr


def test_overrides_may_sit_between_the_options_and_check_exits_before_training(tmp_path, small_data):
    """--check refuses what the run would: a wrong type, and a data prefix without its files; a bare prefix
    (data.train_data=PREFIX) is one dataset."""
    def check(*overrides):
        return subprocess.run([sys.executable, "-m", "fe_megatron.train", "--config", CONFIG, "training.train_steps=50",
                               "--save", str(tmp_path / "run"), "training.log_interval=1", "--check",
                               f"data.tokenizer_model={small_data['tokenizer']}", *overrides],
                              capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"))

    proc = check(f"data.train_data={small_data['prefix']}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    resolved = json.loads(proc.stdout)
    assert resolved["training"]["train_steps"] == 50 and resolved["training"]["log_interval"] == 1
    assert resolved["data"]["train_data"] == [small_data["prefix"]]
    assert resolved["save"] == str(tmp_path / "run") and not os.path.exists(tmp_path / "run")
    proc = check(f"data.train_data={tmp_path / 'nope' / 'text'}")
    assert proc.returncode == 2 and f"data.train_data: {tmp_path / 'nope' / 'text'}.bin does not exist; create it " \
                                   "with fe-data preprocess" in proc.stderr, proc.stderr[-2000:]
    proc = check(f"data.train_data={small_data['prefix']}", "optimizer.lr=fast")
    assert proc.returncode == 2 and "optimizer.lr: 'fast' must be a finite number > 0" in proc.stderr, \
        proc.stderr[-2000:]


# ----------------------------------------------------------------------------- under torchrun
def test_a_refusal_under_torchrun_ends_the_log(tmp_path):
    """fe-pretrain and fe-eval refuse their input with exit status 2; under torchrun each worker also writes
    the message into its error file, so that torchrun's closing summary (the end of the log) shows it rather
    than ``error_file: <N/A>``. The override's value names the field it belongs to. A worker that torchrun
    stopped (SIGTERM) after the first refusal, before it wrote its own, is listed with ``<N/A>`` above the
    root cause, as torchrun lists every stopped worker; the root cause, which ends the log, is the message."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = run(torchrun + ["-m", "fe_megatron.train", "--config", CONFIG, "memory.tables=rowwise_adagrad"])
    tail = "\n".join(proc.stderr.strip().splitlines()[-4:])
    assert proc.returncode != 0 and "did you mean optimizer.table_update=rowwise_adagrad?" in tail, proc.stderr[-3000:]
    root_cause = proc.stderr.rpartition("Root Cause (first observed failure):")[2]
    assert root_cause and "<N/A>" not in root_cause, proc.stderr[-3000:]

    proc = run(torchrun + ["-m", "fe_megatron.evaluation.cli", "ppl", "--load", str(tmp_path / "no_run"),
                           "--data", CONFIG])
    tail = "\n".join(proc.stderr.strip().splitlines()[-4:])
    assert proc.returncode != 0 and "fe-eval ppl: error:" in tail and str(tmp_path / "no_run") in tail, \
        proc.stderr[-3000:]
