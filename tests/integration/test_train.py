"""fe-pretrain end to end: single process, DP=2 and TP=2 under torchrun, resume exactness, other model
kinds, and bad input refused at the start."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers.training import CONFIG, ROOT, curve, metrics, run_pretrain, small_overrides


def test_resume_reproduces_the_uninterrupted_curve_exactly(small_data, tmp_path):
    """With a table learning-rate multiplier: its own optimizer group must survive the checkpoint."""
    full, half = str(tmp_path / "full"), str(tmp_path / "half")
    lr_mult = {"optimizer.table_lr_mult": 2.0}
    run_pretrain(["--config", CONFIG, "--save", full] + small_overrides(small_data, **lr_mult))
    run_pretrain(["--config", CONFIG, "--save", half] + small_overrides(small_data, **lr_mult,
                                                                        **{"training.exit_after": 4}))
    assert open(os.path.join(half, "latest_checkpointed_iteration.txt")).read() == "4"
    resumed = run_pretrain(["--config", CONFIG, "--save", half, "--load", half] +
                           small_overrides(small_data, **lr_mult))
    out = resumed.stdout
    assert "resumed from" in out and "at iteration 4" in out
    assert "Warning" not in resumed.stderr, resumed.stderr  # no third-party noise, also on --load
    assert re.search(r"\| ETA \d+:\d\d:\d\d$", out, re.M)  # log lines say how long is left
    assert curve(metrics(full)) == curve(metrics(half))  # bit-identical floats
    rows = metrics(full)
    logged = [r for r in rows if "lm_loss" in r]
    assert len(logged) == 4 and all(set(r) >= {"lm_loss", "sparsity_loss", "lr", "grad_norm", "tokens_per_s",
                                               "memory_mb"} for r in logged)
    assert logged[0]["sparsity_loss"] > 0 and any("val_ppl" in r for r in rows)
    assert os.listdir(os.path.join(tmp_path, "full"))  # checkpoints written
    assert not any(name.endswith(".tmp") for name in os.listdir(full))


def test_exit_after_saves_first_and_the_next_start_resumes_there_recording_each_step_once(small_data, tmp_path):
    """training.exit_after between two save intervals: a checkpoint at the exit step, a resume there,
    and metrics.jsonl with every step once, also after a restart over records no checkpoint kept."""
    save = str(tmp_path / "run")
    args = ["--config", CONFIG, "--save", save] + small_overrides(small_data, **{"training.save_interval": 100,
                                                                                 "training.log_interval": 1})
    stopped = run_pretrain(args + ["training.exit_after=3"]).stdout
    assert "exiting after step 3 (training.exit_after) with a checkpoint; rerun with --load to resume" in stopped
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "3"
    with open(os.path.join(save, "metrics.jsonl"), "a") as fh:  # as a run killed after step 5 leaves it
        fh.write(json.dumps({"step": 4, "lm_loss": 1.0}) + "\n" + json.dumps({"step": 5, "lm_loss": 1.0}) + "\n")
    resumed = run_pretrain(args + ["--load", save]).stdout
    assert "at iteration 3" in resumed and "dropped 2 record(s) after step 3" in resumed
    rows = metrics(save)
    steps = [(r["step"], "val_loss" in r) for r in rows if "step" in r and "event" not in r]
    assert steps == sorted(set(steps)) and [s for s, _ in steps if not _] == list(range(1, 9)), steps
    assert [r["start_step"] for r in rows if r.get("event") == "start"] == [0, 3]


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_a_run_extended_on_purpose_follows_the_new_schedule_and_by_default_keeps_its_own(small_data, tmp_path, engine):
    """A 4-step run resumed for 8 steps at another peak rate: by default the rate stays at min_lr after
    step 4 (the checkpoint's schedule); with training.schedule_on_resume=config it follows the new 8-step
    schedule from step 4 on.  (megatron-core 0.19 pairs saved and current parameter groups by their rates
    too: compat.adopt_checkpoint_group_values.)"""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed", reason="DeepSpeed is installed by the project's set-up (make setup)")
    base = small_overrides(small_data, **{"training.log_interval": 1, "training.save_interval": 4,
                                          "training.engine": engine})
    eight = str(tmp_path / "eight")  # the schedule asked for on resume: 8 steps at another peak rate
    run_pretrain(["--config", CONFIG, "--save", eight] + base + ["optimizer.lr=2e-3"])
    expected = {r["step"]: r["lr"] for r in metrics(eight) if "lr" in r}
    four = str(tmp_path / "four")  # the run to extend, resumed once each way
    run_pretrain(["--config", CONFIG, "--save", four] + base + ["training.train_steps=4"])
    for mode in ("checkpoint", "config"):
        save = str(tmp_path / mode)
        shutil.copytree(four, save)
        out = run_pretrain(["--config", CONFIG, "--save", save, "--load", save] + base +
                           [f"training.schedule_on_resume={mode}", "optimizer.lr=2e-3"]).stdout
        lr = {r["step"]: r["lr"] for r in metrics(save) if "lr" in r}
        if mode == "config":
            assert "from this step on the run follows this config's schedule (optimizer.lr 0.003 -> 0.002, " \
                   "training.train_steps 4 -> 8)" in out
            assert [lr[s] for s in range(5, 9)] == pytest.approx([expected[s] for s in range(5, 9)], rel=1e-9)
        else:
            assert "To extend the run on this config's schedule, resume with training.schedule_on_resume=config" in out
            assert [lr[s] for s in range(5, 9)] == pytest.approx([3e-4] * 4, rel=1e-9), lr  # min_lr


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [["parallel.tensor=1"], ["parallel.tensor=2", "parallel.sequence_parallel=true"],
                                      ["parallel.table_sharding=rows"]],
                         ids=["dp2", "tp2-sp", "dp2-rows"])
def test_torchrun_two_processes(small_data, tmp_path, parallel):
    save = str(tmp_path / "run")
    proc = run_pretrain(["--config", CONFIG, "--save", save] + small_overrides(small_data, **{
        "training.train_steps": 4, "training.save_interval": 4}) + parallel, nproc=2, ends_cleanly=True)
    out = proc.stdout
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in proc.stderr  # fe-pretrain sets it as Megatron-LM's scripts do
    dp = 1 if "parallel.tensor=2" in parallel else 2
    assert f"DP={dp}" in out
    if "parallel.table_sharding=rows" in parallel:  # the same parameter count as whole tables
        whole = run_pretrain(["--config", CONFIG, "--save", str(tmp_path / "whole")] + small_overrides(
            small_data, **{"training.train_steps": 3, "training.save_interval": 3}), nproc=1).stdout
        assert re.search(r"model factorengram: ([\d,]+) parameters", out).group(1) == \
            re.search(r"model factorengram: ([\d,]+) parameters", whole).group(1)
    rows = metrics(save)
    final = [r for r in rows if r.get("event") == "final"][0]
    assert final["test_loss"] > 0 and rows[1]["lm_loss"] < 7.0
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "4"


@pytest.mark.distributed
def test_the_logged_validation_and_test_losses_do_not_depend_on_the_layout(small_data, tmp_path):
    """The same weights at DP=1 and DP=2 (the training losses agree) give the same validation and test
    losses: the evaluation reads the same tokens at every data-parallel size."""
    def losses(nproc):
        save = str(tmp_path / f"dp{nproc}")
        run_pretrain(["--config", CONFIG, "--save", save] + small_overrides(small_data, **{
            "training.train_steps": 4, "training.save_interval": 4, "training.eval_steps": 3}), nproc=nproc)
        rows = metrics(save)
        return ([r["lm_loss"] for r in rows if "lm_loss" in r], [r["val_loss"] for r in rows if "val_loss" in r],
                [r["test_loss"] for r in rows if "test_loss" in r])

    one, two = losses(1), losses(2)
    for name, a, b in zip(("training", "validation", "test"), one, two):
        assert len(a) == len(b) and a == pytest.approx(b, rel=1e-5), (name, a, b)


@pytest.mark.distributed
@pytest.mark.parametrize("tables", ["replicated", "node"])
def test_distributed_optimizer_resume_reproduces_the_curve_exactly(small_data, tmp_path, tables):
    """DP=2 with the distributed optimizer (each rank holds its share of the Adam state), whole or
    node-shared tables (row shards in host memory, the node's kept once in shared memory: the start-up
    line says so, and the folder is empty during and after the runs): stop at step 4, resume, and end on
    the uninterrupted run's curve bit for bit.  Row-sharded tables resume in tests/integration/
    test_row_sharding.py and test_multinode.py, and node-shared ones train as row-sharded ones, bit for bit
    (test_multinode.py)."""
    full, half, folder = str(tmp_path / "full"), str(tmp_path / "half"), tmp_path / "shm"
    folder.mkdir()
    extra = {"parallel.distributed_optimizer": "true", "parallel.table_sharding": tables,
             "optimizer.table_lr_mult": 2.0, "training.log_interval": 1}
    if tables == "node":
        extra.update({"memory.table_placement": "host", "parallel.shared_table_folder": str(folder)})
    run_pretrain(["--config", CONFIG, "--save", full] + small_overrides(small_data, **extra), nproc=2)
    run_pretrain(["--config", CONFIG, "--save", half] + small_overrides(small_data, **extra,
                                                                        **{"training.exit_after": 4}), nproc=2)
    out = run_pretrain(["--config", CONFIG, "--save", half, "--load", half] + small_overrides(small_data, **extra),
                       nproc=2).stdout
    assert "at iteration 4" in out
    assert curve(metrics(full)) == curve(metrics(half)) and len(curve(metrics(full))) >= 8
    if tables == "node":
        assert f"in shared host memory ({folder}), one copy per node" in out and os.listdir(folder) == []


def test_cpp_kernels_change_no_bit_of_a_cpu_run(small_data, tmp_path):
    """fp32 on CPU: the cpp hash, gather and table backward (into DDP's main_grad) are
    bit-identical to the torch reference, so forcing the reference reproduces the default
    run's losses and validation exactly."""
    curves = {}
    for backend, expected in (("auto", "cpp"), ("torch", "torch")):
        save = str(tmp_path / backend)
        out = run_pretrain(["--config", CONFIG, "--save", save] + small_overrides(
            small_data, **{"training.train_steps": 4, "training.kernel_backend": backend})).stdout
        assert f"kernels: {expected} (built: torch, cpp" in out and "table gradients deterministic" in out
        curves[backend] = curve(metrics(save))
    assert len(curves["auto"]) >= 2 and curves["auto"] == curves["torch"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error for an unbuilt cuda backend")
def test_unbuilt_kernel_backend_fails_at_start(small_data, tmp_path):
    proc = run_pretrain(["--config", CONFIG] + small_overrides(small_data, **{"training.kernel_backend": "cuda"}),
                        check=False)
    assert proc.returncode == 2
    assert "training.kernel_backend: kernel backend 'cuda' is not available here: it needs a CUDA device" in proc.stderr
    assert "Available: ['torch', 'cpp'" in proc.stderr


@pytest.mark.parametrize("kind", ["engram", "transformer"])
def test_other_model_kinds_train(small_data, tmp_path, kind):
    extra = {"training.train_steps": 4}
    if kind == "engram":
        extra.update({"memory.preset": "engram-340m", "memory.ngram_orders": "[2, 3]",
                      "memory.table_capacity": "[4096, 4096]", "memory.coeff_width": 64, "memory.memory_dim": 64,
                      "memory.layers": "[1, 2]", "memory.heads_per_order": 2})
    else:
        extra["memory"] = "null"
    extra["training.global_batch_size"] = 2  # one microbatch per step
    out = run_pretrain(["--config", CONFIG, "--save", str(tmp_path)] + small_overrides(small_data, **extra)).stdout
    assert "1 microbatch of 2 x 64 tokens" in out
    assert ("| sparsity " in out) == (kind != "transformer")  # no sparsity column without memory
    rows = metrics(str(tmp_path))
    assert rows[0]["kind"] == kind and [r for r in rows if r.get("event") == "final"]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]  # steps 2 and 4: finite, and the model learns
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[1] < losses[0], losses


def test_tokenizer_larger_than_model_vocab_fails_at_start(small_data, tmp_path):
    proc = run_pretrain(["--config", CONFIG] + small_overrides(small_data, **{"model.vocab_size": 256,
                                                                              "memory.table_capacity": "[256, 4096, 4096]"}),
                        check=False)
    assert proc.returncode == 2
    assert "has 512 tokens but model.vocab_size=256" in proc.stderr


def test_data_made_with_another_tokenizer_fails_before_the_run_starts(small_data, tmp_path):
    """The data was made with a 512-piece tokenizer; the run is given a 320-piece one and a 320-token
    vocabulary.  Without the check it started and failed at the first forward, on a token id outside
    the vocabulary, and left a metrics.jsonl that the next start reported dropping."""
    from fe_megatron.data.cli import main as fe_data

    smaller = tmp_path / "tok320"
    assert fe_data(["train-tokenizer", "--input", small_data["subset"], "--output-prefix", str(smaller),
                    "--vocab-size", "320"]) == 0
    save = tmp_path / "run"
    proc = run_pretrain(["--config", CONFIG, "--save", str(save)] + small_overrides(small_data, **{
        "data.tokenizer_model": f"{smaller}.model", "model.vocab_size": 320,
        "memory.table_capacity": "[320, 4096, 4096]"}), check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(rf"fe-pretrain: error: {re.escape(small_data['prefix'])}\.bin holds token id \d{{3}} \(its "
                     rf"largest; every token read\), but the tokenizer {re.escape(str(smaller))}\.model has 320 "
                     rf"pieces \(ids 0 to 319\): the data was made with another, larger tokenizer\. Re-run "
                     rf"`fe-data preprocess --tokenizer-model ", proc.stderr), proc.stderr[-2000:]
    assert not (save / "metrics.jsonl").exists()


def test_missing_dataset_fails_at_start(small_data, tmp_path):
    proc = run_pretrain(["--config", CONFIG] + small_overrides(small_data, **{"data.train_data": "[/nonexistent/x]"}),
                        check=False)
    assert proc.returncode == 2 and "/nonexistent/x.bin does not exist" in proc.stderr


def test_a_configuration_error_is_one_message_before_any_worker_starts():
    """launch_scripts/torchrun.sh checks the configuration in one process first; a worker other than rank
    0 that meets the error (plain torchrun) stays silent, so there is one message either way."""
    env = dict(os.environ, NPROC_PER_NODE="2", PYTHON=sys.executable, PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", os.path.join(ROOT, "launch_scripts", "torchrun.sh"), "--config", CONFIG,
                           "training.train_steps=5"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.count("fe-pretrain: error:") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "(set by the override 'training.train_steps=5')" in proc.stderr
    worker = subprocess.run([sys.executable, "-m", "fe_megatron.train", "--config", CONFIG, "training.train_steps=5"],
                            capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, RANK="1"))
    assert worker.returncode == 2 and worker.stderr == ""


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_run_starts_from_the_weights_of_a_converted_checkpoint(small_data, tmp_path, precision):
    """A converted checkpoint (fe-convert hf-to-mcore: weights only) as a run's --load. Megatron's
    mixed-precision optimizer (bf16) keeps fp32 main parameters, copied when it was built: they are
    refreshed from the loaded weights, else its first step writes the initial weights back over them.
    After one step every weight lies within Adam's first step (at most the learning rate per element),
    plus bf16 rounding, of the converted ones; the bf16 run's initial weights would miss by far more."""
    import torch
    from safetensors.torch import load_file

    from fe_megatron.convert.to_hf import mcore_to_hf
    from fe_megatron.convert.to_mcore import hf_to_mcore
    from fe_megatron.deepspeed.engine import build_model
    from fe_megatron.training.config import load_train_config

    one_step = {"training.train_steps": 1, "optimizer.warmup_steps": 0, "training.save_interval": 1,
                "training.eval_interval": 1, "training.log_interval": 1, "training.precision": precision}
    cfg = load_train_config(CONFIG, small_overrides(small_data, **one_step))
    torch.manual_seed(5)
    start = str(tmp_path / "start_hf")
    build_model(cfg).save_pretrained(start)
    shutil.copyfile(small_data["tokenizer"], os.path.join(start, "tokenizer.model"))
    save = str(tmp_path / "run")
    out = run_pretrain(["--config", CONFIG, "--save", save, "--load", hf_to_mcore(start, str(tmp_path / "start"))]
                       + small_overrides(small_data, **one_step)).stdout
    assert "a converted checkpoint: no optimizer state" in out, out[-2000:]

    def weights(directory):
        return {k: v.float() for f in os.listdir(directory) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(directory, f)).items()}

    before, after = weights(start), weights(mcore_to_hf(save, str(tmp_path / "after_hf")))
    assert before.keys() == after.keys()
    bound = {name: cfg.optimizer.lr * 1.01 + (2 ** -8 if precision == "bf16" else 0) * before[name].abs().max().item()
             for name in before}
    worst = max(before, key=lambda name: (after[name] - before[name]).abs().max().item() / bound[name])
    moved = (after[worst] - before[worst]).abs().max().item()
    assert moved <= bound[worst], f"{worst} moved by {moved:.3g} in one step (at most {bound[worst]:.3g})"
