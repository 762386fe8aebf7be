"""What a new user meets: help texts, error messages and their wording, no third-party noise."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

BIN = os.path.dirname(sys.executable)


def command(name: str) -> list:
    """An installed console script, as a user runs it."""
    path = os.path.join(BIN, name)
    assert os.path.isfile(path), f"{name} is not installed in {BIN}"
    return [path]


def run(cmd, **kwargs):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, **kwargs)


def test_fe_pretrain_without_arguments_asks_for_the_config():
    proc = run(command("fe-pretrain"))
    assert proc.returncode == 2
    assert "the following arguments are required: --config" in proc.stderr and "memory" not in proc.stderr


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


@pytest.mark.parametrize("subcommand", ["train-tokenizer", "preprocess"])
def test_every_fe_data_option_explains_itself(subcommand):
    import argparse

    from fe_megatron.data import cli

    captured = {}
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        captured["parser"] = self
        return original(self, args, namespace)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(SystemExit):
            cli.main([subcommand, "--help"])
    sub = next(a for a in captured["parser"]._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[subcommand]
    assert parser.description
    for action in parser._actions:
        assert action.help, f"fe-data {subcommand} {action.option_strings} has no help text"


def test_hf_input_without_datasets_names_the_extra_and_writes_nothing(tmp_path, monkeypatch, small_data):
    from fe_megatron.data.cli import main as fe_data

    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    prefix = tmp_path / "out" / "fineweb"
    rc = fe_data(["preprocess", "--input", "hf:HuggingFaceFW/fineweb-edu:sample-10BT", "--tokenizer-model",
                  small_data["tokenizer"], "--output-prefix", str(prefix), "--no-progress"])
    assert rc == 2
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_hf_error_text(monkeypatch):
    from fe_megatron.data.sources import DataError, validate_inputs

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"reading hf:NAME inputs needs the Hugging Face 'datasets' package, which is "
                                        r"not installed; install it with: pip install 'fe_megatron\[hf\]'"):
        validate_inputs(["hf:some/dataset"], "text")


def test_fe_data_prints_no_third_party_warnings(small_data, tmp_path):
    proc = run(command("fe-data") + ["preprocess", "--input", small_data["subset"], "--tokenizer-model",
                                      small_data["tokenizer"], "--output-prefix", str(tmp_path / "x"),
                                      "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr


def test_fe_demo_refuses_zero_steps():
    proc = run(command("fe-demo") + ["--steps", "0"])
    assert proc.returncode == 2 and "argument --steps: 0 is not a positive number of steps" in proc.stderr


def test_fe_demo_with_few_steps_scales_warmup_and_starts_tensorboard_clean(tmp_path):
    stale = tmp_path / "tensorboard" / "factorengram"
    stale.mkdir(parents=True)
    (stale / "events.out.tfevents.stale").write_text("old run")
    proc = run(command("fe-demo") + ["--steps", "3", "--paired-steps", "2", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-2000:]
    assert "optimizer.warmup_steps=0" in proc.stdout
    assert not (stale / "events.out.tfevents.stale").exists() and len(os.listdir(stale)) == 1
    assert "model            val ppl  test ppl    parameters   tokens/s" in proc.stdout
    # the tokens/s come from one process that alternated one step of each model, after training
    throughput = json.loads((tmp_path / "throughput.json").read_text())
    assert throughput["method"] == "paired" and throughput["steps_per_model"] == 2
    assert [len(throughput["step_seconds"][kind]) for kind in ("factorengram", "transformer")] == [2, 2]
    assert "(tokens/s: the median step of 2 training steps of each model after training, alternating one step of " \
           "each in one process, so both ran under the same load; factorengram / transformer = " in proc.stdout
    assert f"TensorBoard: {os.path.join(BIN, 'tensorboard')} --logdir {tmp_path / 'tensorboard'}" in proc.stdout


def test_the_demo_times_both_models_alternately_so_that_they_meet_the_same_load():
    """Two fe-pretrain processes one after the other met different loads on a busy machine (their
    tokens/s ratio 0.48 to 0.85); the demo's throughput is one step of each model in turn, and the
    medians leave out the steps that waited for a core."""
    from types import SimpleNamespace

    from fe_megatron.demo import time_alternating_steps

    calls, now = [], [0.0]

    def fake_run(kind, step_seconds):
        def train_step(batches):
            calls.append((kind, batches))
            now[0] += step_seconds[(len(calls) - 1) // 2]

        cfg = SimpleNamespace(training=SimpleNamespace(global_batch_size=4), model=SimpleNamespace(seq_length=8))
        return SimpleNamespace(cfg=cfg, datasets=("train", "valid", "test"), num_microbatches=2,
                               batches=lambda dataset, first, n: (dataset, first, n), train_step=train_step,
                               advance_schedule=lambda: None)

    # the first step is the warm-up; the third step of the factorengram model waits for a core
    record = time_alternating_steps({"factorengram": fake_run("factorengram", [9.0, 0.5, 0.5, 8.0, 0.5]),
                                     "transformer": fake_run("transformer", [9.0, 0.25, 0.25, 0.25, 0.25])},
                                    steps=4, warmup_steps=1, clock=lambda: now[0])
    assert [kind for kind, _ in calls] == ["factorengram", "transformer"] * 5
    assert [batches for kind, batches in calls if kind == "transformer"] == [("train", first, 2) for first in
                                                                             (0, 4, 8, 12, 16)]
    assert record["method"] == "paired"
    assert record["order"] == "alternating: factorengram, transformer, factorengram, ..."
    assert record["steps_per_model"] == 4 and record["warmup_steps_per_model"] == 1
    assert record["step_seconds"] == {"factorengram": [0.5, 0.5, 8.0, 0.5], "transformer": [0.25] * 4}
    assert record["tokens_per_s"] == {"factorengram": 64.0, "transformer": 128.0}  # 32 tokens per median step
    assert record["mean_tokens_per_s"] == {"factorengram": 128 / 9.5, "transformer": 128.0}
    assert record["ratio"] == 0.5 and record["ratio_of"] == "factorengram / transformer"
    assert set(record["load_average_1min"]) == {"before", "after"} and record["cpus"] == os.cpu_count()


def test_fe_demo_outside_a_repository_says_what_it_needs(monkeypatch, tmp_path, capsys):
    from fe_megatron import demo

    monkeypatch.setattr(demo, "CORPUS", str(tmp_path / "data" / "sotu.jsonl.gz"))
    with pytest.raises(SystemExit, match=r"sotu\.jsonl\.gz is missing\. fe-demo runs from a clone of the fe_megatron "
                                         r"repository .*run `make demo` in it"):
        demo.main(["--out", str(tmp_path / "out")])
    assert not os.path.exists(tmp_path / "out")


def test_fe_plan_says_which_dtype_it_counts_in():
    out = run(command("fe-plan") + ["--preset", "factorengram-tiny", "--dp", "2"]).stdout
    assert "# counted in: tables fp32 weights, fp32 gradients and Adam moments (16 bytes per parameter), in device " \
           "memory; rest bf16 weights, fp32 gradients and Adam state" in out
    out = run(command("fe-plan") + ["--preset", "factorengram-tiny", "--dp", "2", "--table-dtype", "bf16"]).stdout
    assert "# counted in: tables bf16 weights, fp32 gradients and Adam moments (14 bytes per parameter)" in out


def test_graft_lists_the_memory_presets():
    from fe_megatron.presets import PRESETS

    proc = run(command("fe-convert") + ["graft", "--help"])
    assert "--list-presets" not in proc.stdout and "factorengram-tiny" in proc.stdout
    proc = run(command("fe-convert") + ["graft", "--base", "x", "--memory-preset", "nope", "--output", "y"])
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr and sorted(PRESETS)[0] in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU: make gpu-check runs")
def test_gpu_check_without_a_gpu_says_so_and_runs_nothing(tmp_path):
    out = tmp_path / "gpu_results"
    proc = run([sys.executable, "benchmarks/gpu_check.py", "--out", str(out)])
    assert proc.returncode == 2
    assert "no GPU is visible" in proc.stderr and "nothing was run" in proc.stderr
    assert not out.exists()


def test_gpu_check_budget_ends_commands_with_their_children_and_refuses_to_start_late(tmp_path, monkeypatch):
    """gpu_check's Checker: a command outliving what is left of --budget-s is killed with the processes
    it started (its own session), and a command with too little left is not started (BudgetSpent)."""
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("gpu_check", "benchmarks/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setattr(gpu_check, "MIN_COMMAND_S", 1)
    checker = gpu_check.Checker(str(tmp_path), budget_s=3)
    marker = tmp_path / "child_survived"
    # the shell starts a child that would write the marker after 6 s, then waits for it
    script = f"(sleep 6; touch {marker}) & wait"
    start = time.monotonic()
    rc, output = checker.run("sleeper", ["bash", "-c", script], timeout=600)
    assert rc == 124 and "timed out after" in output and time.monotonic() - start < 5
    with pytest.raises(gpu_check.BudgetSpent):
        checker.run("late", [sys.executable, "-c", "print('ran')"], timeout=600)
    assert "not run: the time budget is spent" in (tmp_path / "logs" / "late.log").read_text()
    time.sleep(4)
    assert not marker.exists(), "the command's child outlived the timeout"
    curve = tmp_path / "metrics.jsonl"
    curve.write_text('{"step": 10, "lm_loss": 6.5}\n{"step": 20, "lm_lo')  # a run stopped mid-write
    assert gpu_check.lm_curve(str(tmp_path)) == {10: 6.5}
