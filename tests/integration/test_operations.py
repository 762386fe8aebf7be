"""Runs that survive failures: checksums, resume guards, non-finite steps, restarts, preemption."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fe_megatron.checkpoint.files import MANIFEST, RUN_INFO, complete_iterations, read_tracker
from tests.helpers.training import (CONFIG, ROOT, curve, final_curve, metrics, metrics_if_any, pretrain_cmd,
                                    run_pretrain, small_overrides)


def train(data, save, *extra_args, nproc=1, check=True, env=None, **overrides):
    args = ["--config", CONFIG, "--save", save, *extra_args] + small_overrides(data, **overrides)
    return run_pretrain(args, nproc=nproc, check=check, extra_env=env)


def same_tensors(a: str, b: str) -> str:
    """Compare every tensor of two checkpoints, weights and optimizer states, bit for bit (read with
    torch.distributed.checkpoint, as fe-convert reads them: no process group, any megatron-core)."""
    from fe_megatron.convert.megatron_reader import DistCheckpoint

    x, y = DistCheckpoint(a), DistCheckpoint(b)
    names = [name for name, meta in x.metadata.items() if hasattr(meta, "size")]
    other = [name for name, meta in y.metadata.items() if hasattr(meta, "size")]
    if sorted(names) != sorted(other):
        return f"different names: {sorted(set(names) ^ set(other))[:5]}"
    bad = [name for name in names if not torch.equal(x.load(name), y.load(name))]
    return ("equal" if not bad else f"different: {bad[:5]}") + f" {len(names)}"


@pytest.fixture(scope="module")
def uninterrupted(small_data, tmp_path_factory):
    """8 steps in one go, checkpoints at 4 and 8: the curve every interrupted run must end on."""
    save = str(tmp_path_factory.mktemp("ops") / "full")
    train(small_data, save)
    return save


def test_every_checkpoint_carries_checksums_and_the_config(uninterrupted):
    assert complete_iterations(uninterrupted) == [4, 8] and read_tracker(uninterrupted) == 8
    folder = os.path.join(uninterrupted, "iter_0000008")
    manifest = json.load(open(os.path.join(folder, MANIFEST)))
    files = [name for name in os.listdir(folder) if name != MANIFEST]
    assert sorted(manifest["files"]) == sorted(files) and manifest["iteration"] == 8
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"].values())
    info = json.load(open(os.path.join(folder, RUN_INFO)))
    assert info["config"]["memory"]["hash_seed"] == 0 and len(info["tokenizer"]["sha256"]) == 64
    assert info["layout"] == {"world": 1, "tensor": 1, "pipeline": 1, "data": 1, "table_sharding": "replicated"}


@pytest.mark.parametrize("damage, fragment", [
    ("flip", "its sha256 differs from the manifest's (the file is damaged)"),
    ("truncate", "bytes, the manifest says"),
    ("delete", ": missing"),
    ("delete the manifest", ": missing"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file(small_data, uninterrupted, tmp_path, damage, fragment):
    import shutil

    run = str(tmp_path / "run")
    shutil.copytree(uninterrupted, run)
    folder = os.path.join(run, "iter_0000008")
    victim = os.path.join(folder, MANIFEST if damage == "delete the manifest" else
                          sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0])
    if damage == "flip":
        with open(victim, "r+b") as fh:
            fh.seek(os.path.getsize(victim) // 2)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        with open(victim, "r+b") as fh:
            fh.truncate(os.path.getsize(victim) - 100)
    else:
        os.remove(victim)
    proc = train(small_data, run, "--load", run, check=False)
    assert proc.returncode == 2
    assert f"checkpoint {folder} is damaged" in proc.stderr and f"{victim}:" \
        in proc.stderr and fragment in proc.stderr and "training.on_corrupt_checkpoint=previous" in proc.stderr
    if damage != "flip":
        return  # the fallback does not depend on the kind of damage: run once
    # asked to, it falls back to the checkpoint before and ends on the uninterrupted curve
    out = train(small_data, run, "--load", run, **{"training.on_corrupt_checkpoint": "previous"}).stdout
    assert "trying the checkpoint before it" in out and "at iteration 4" in out
    assert final_curve(run) == final_curve(uninterrupted)


def test_a_run_killed_while_saving_resumes_from_the_previous_checkpoint(small_data, uninterrupted, tmp_path):
    run = str(tmp_path / "run")
    proc = train(small_data, run, check=False, env={"FE_MEGATRON_FAULTS": "kill_during_save@8"})
    assert proc.returncode == -signal.SIGKILL
    assert read_tracker(run) == 4 and os.path.isdir(os.path.join(run, "iter_0000008.tmp"))
    out = train(small_data, run, "--load", run).stdout
    assert "at iteration 4" in out and final_curve(run) == final_curve(uninterrupted)


@pytest.mark.distributed
def test_a_save_that_fails_on_one_rank_moves_no_tracker(small_data, tmp_path):
    run = str(tmp_path / "run")
    proc = train(small_data, run, nproc=2, check=False, env={"FE_MEGATRON_FAULTS": "fail_after_save@8:1"})
    assert proc.returncode != 0
    assert "saving iteration 8 failed on 1 rank(s)" in proc.stderr + proc.stdout
    assert read_tracker(run) == 4 and complete_iterations(run) == [4]


def test_keep_checkpoints_keeps_the_newest(small_data, tmp_path):
    run = str(tmp_path / "run")
    train(small_data, run, **{"training.save_interval": 2, "training.keep_checkpoints": 2})
    assert complete_iterations(run) == [6, 8] and read_tracker(run) == 8


def test_resume_with_a_changed_hash_seed_or_shape_is_refused_and_allowed_changes_are_listed(small_data, uninterrupted,
                                                                                             tmp_path):
    import shutil

    run = str(tmp_path / "run")
    shutil.copytree(uninterrupted, run)
    proc = train(small_data, run, "--load", run, check=False, **{"memory.hash_seed": 5, "memory.memory_dim": 64})
    assert proc.returncode == 2
    assert "memory.hash_seed is 0 in the checkpoint and 5 now; it sets the address of every hashed table row" \
        in proc.stderr
    assert "memory.memory_dim is 128 in the checkpoint and 64 now" in proc.stderr
    out = train(small_data, run, "--load", run, **{"training.train_steps": 10, "optimizer.lr": 0.002}).stdout
    assert "changed since the checkpoint: optimizer.lr: 0.003 -> 0.002" in out
    assert "changed since the checkpoint: training.train_steps: 8 -> 10" in out and "at iteration 8" in out


def test_nonfinite_loss_halts_without_saving(small_data, tmp_path):
    run = str(tmp_path / "run")
    proc = train(small_data, run, check=False, env={"FE_MEGATRON_FAULTS": "nan_loss@3"},
                 **{"training.save_interval": 2})
    assert proc.returncode == 3
    assert "non-finite loss or gradient norm at step 3" in proc.stderr
    assert "rank 0 microbatch 0: lm loss nan" in proc.stderr and "Halting without saving" in proc.stderr
    assert complete_iterations(run) == [2] and read_tracker(run) == 2


def test_nonfinite_loss_can_skip_the_step(small_data, tmp_path):
    run = str(tmp_path / "run")
    out = train(small_data, run, env={"FE_MEGATRON_FAULTS": "nan_loss@3"},
                **{"training.on_nonfinite": "skip"}).stdout
    assert "skipped the update (training.on_nonfinite=skip; 1 step(s) skipped so far)" in out
    final = [r for r in metrics(run) if r.get("event") == "final"][0]
    assert final["skipped_steps"] == 1 and final["test_loss"] == final["test_loss"]  # finite weights: not NaN
    assert all(r["val_loss"] == r["val_loss"] for r in metrics(run) if "val_loss" in r)


def test_resume_with_dropout_is_exact_because_random_states_are_saved(small_data, tmp_path):
    full, half = str(tmp_path / "full"), str(tmp_path / "half")
    dropout = {"model.dropout": 0.1, "training.log_interval": 1}
    train(small_data, full, **dropout)
    train(small_data, half, **dropout, **{"training.exit_after": 4})
    out = train(small_data, half, "--load", half, **dropout).stdout
    assert "random states restored" in out
    assert curve(metrics(full)) == [row for row in curve(metrics(half))]


def test_sigusr1_saves_after_the_step_and_asks_for_a_requeue(small_data, uninterrupted, tmp_path):
    run = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(OMP_NUM_THREADS="1")
    args = pretrain_cmd(1) + ["--config", CONFIG, "--save", run] + small_overrides(small_data, **{
        "training.log_interval": 1, "training.train_steps": 40, "training.save_interval": 100})
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    deadline = time.time() + 300
    while time.time() < deadline and not any(r.get("step", 0) >= 3 for r in metrics_if_any(run)):
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    stopped = read_tracker(run)
    assert "SIGUSR1: stopped after step" in out and 3 <= stopped < 40
    assert open(os.path.join(run, "requeue_requested")).read() == str(stopped)
    out = train(small_data, run, "--load", run, **{"training.log_interval": 1, "training.train_steps": 40,
                                                     "training.save_interval": 100}).stdout
    assert f"at iteration {stopped}" in out and not os.path.exists(os.path.join(run, "requeue_requested"))


@pytest.mark.distributed
def test_torchrun_restarts_a_worker_killed_mid_save_and_ends_on_the_uninterrupted_run(small_data, tmp_path):
    """kill -9 of one worker of a DP=2 run under launch_scripts/torchrun.sh with MAX_RESTARTS=1, in the middle of
    saving checkpoint 12 (every part written, the checkpoint not committed: rank 0 commits): the group restarts,
    resumes from the last complete checkpoint (8), and ends with the same losses and weights, bit for bit.  Its
    tables are node-shared (one segment in shared memory for the node, `fe_megatron.tables.node_shared`), saved by
    their owners: the killed run leaves no segment behind, and the restart makes its own."""
    from fe_megatron.tables.node_shared import PREFIX

    full, run, folder = str(tmp_path / "full"), str(tmp_path / "run"), tmp_path / "shm"
    folder.mkdir()
    steps = {"training.train_steps": 16, "training.log_interval": 1, "training.save_interval": 4,
             "memory.table_placement": "host", "parallel.table_sharding": "node",
             "parallel.shared_table_folder": str(folder)}
    train(small_data, full, nproc=2, **steps)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", NPROC_PER_NODE="2", MAX_RESTARTS="1", PYTHON=sys.executable,
               FE_MEGATRON_FAULTS="kill_during_save@12:0")  # the first attempt's committing rank only
    cmd = ["bash", "launch_scripts/torchrun.sh", "--config", CONFIG, "--save", run, "--load", run] + \
        small_overrides(small_data, **steps)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                          timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "failed (exitcode: -9) local_rank: 0" in out, out[-3000:]  # torchrun saw the worker killed
    assert "connectFullMesh" not in out and "at iteration 8" in out
    assert final_curve(run) == final_curve(full)
    assert same_tensors(os.path.join(full, "iter_0000016"), os.path.join(run, "iter_0000016")).startswith("equal")
    assert not [name for name in os.listdir(folder) if name.startswith(PREFIX)]
