"""The launch scripts under a real one-node SLURM: a job runs to completion, and a job sent
SIGUSR1 mid-run saves, requeues itself and ends on the uninterrupted job's losses.

The cluster is `tests/helpers/cluster.py`'s, with one node (its own munged, slurmctld and slurmd, from
Debian's slurm-wlm and munge, which .ci/run installs); the jobs of several nodes are in
`tests/integration/test_multinode.py`.  The tests skip, saying why, where SLURM, root or network namespaces
are missing."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers.cluster import Cluster, job_log, why_no_cluster
from tests.helpers.torchrun_util import clean_environment
from tests.helpers.training import CONFIG, ROOT, final_curve, metrics, metrics_if_any, small_overrides

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = why_no_cluster()
    if why:
        pytest.skip(why)
    with Cluster(tmp_path_factory.mktemp("slurm"), nodes=1, cpus=os.cpu_count()) as cluster:
        yield cluster


def sbatch(cluster, run_dir, data, *extra, steps=16):
    """Submit launch_scripts/slurm/pretrain.sbatch with DP=2 on CPU; returns the job id."""
    overrides = small_overrides(data, **{"training.train_steps": steps, "training.log_interval": 1,
                                         "training.save_interval": 8}, **dict(x.split("=", 1) for x in extra))
    job_env = clean_environment(CONFIG=CONFIG, RUN_DIR=str(run_dir), NPROC_PER_NODE="2", PYTHON=sys.executable)
    return cluster.sbatch([f"--output={run_dir}.out", "launch_scripts/slurm/pretrain.sbatch", *overrides],
                          env=job_env, cwd=ROOT)


def wait_for(cluster, job, run_dir):
    fields = cluster.wait(job, timeout=900, describe=lambda: f"; its log: {job_log(run_dir)}")
    return fields["JobState"], int(fields["Restarts"])


@pytest.fixture(scope="module")
def uninterrupted_job(slurm, small_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("jobs") / "full"
    job = sbatch(slurm, run_dir, small_data)
    return job, run_dir, wait_for(slurm, job, run_dir)


def test_a_job_runs_to_completion(uninterrupted_job):
    job, run_dir, (state, restarts) = uninterrupted_job
    assert (state, restarts) == ("COMPLETED", 0), job_log(run_dir)
    final = [r for r in metrics(run_dir / "checkpoints") if r.get("event") == "final"]
    assert len(final) == 1 and final[0]["step"] == 16
    assert (run_dir / "checkpoints" / "iter_0000016").is_dir()
    assert "2 worker(s)" in open(f"{run_dir}.out").read()


def test_a_job_sent_sigusr1_requeues_and_ends_on_the_uninterrupted_loss(slurm, small_data, uninterrupted_job,
                                                                          tmp_path):
    run_dir = tmp_path / "preempted"
    job = sbatch(slurm, run_dir, small_data)
    deadline = time.time() + 300
    while time.time() < deadline and not any(r.get("step", 0) >= 3 for r in metrics_if_any(run_dir / "checkpoints")):
        time.sleep(0.2)
    # what --signal=USR1@300 sends before the time limit: SIGUSR1 to every process of the job's steps
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm.env, check=True)
    state, restarts = wait_for(slurm, job, run_dir)
    assert (state, restarts) == ("COMPLETED", 1), job_log(run_dir)
    log = open(f"{run_dir}.out").read()
    assert "after a stop signal; requeueing job" in log and "(restart 1)" in log
    _, full_dir, _ = uninterrupted_job
    ours, theirs = final_curve(str(run_dir / "checkpoints")), final_curve(str(full_dir / "checkpoints"))
    assert ours == theirs
    assert [r["test_loss"] for r in metrics(run_dir / "checkpoints") if r.get("event") == "final"] == \
        [r["test_loss"] for r in metrics(full_dir / "checkpoints") if r.get("event") == "final"]


def test_the_ablation_array_runs_one_config_per_task(slurm, small_data, tmp_path):
    import yaml

    with open(CONFIG) as fh:
        base = yaml.safe_load(fh)
    configs = []
    for name, memory in (("basis_gate", base["memory"]), ("scalar_gate", dict(base["memory"], gate="scalar"))):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(dict(base, memory=memory)))
        configs.append(str(path))
    overrides = small_overrides(small_data, **{"training.train_steps": 4, "training.eval_interval": 4,
                                               "training.save_interval": 4})
    job_env = clean_environment(ABLATION_CONFIGS=" ".join(configs), RUN_DIR_ROOT=str(tmp_path / "runs"),
                                NPROC_PER_NODE="1", PYTHON=sys.executable)
    array = slurm.sbatch(["--array=0-2", f"--output={tmp_path}/task-%a.out", "launch_scripts/slurm/ablations.sbatch",
                          *overrides], env=job_env, cwd=ROOT)
    def task_outputs():
        return "".join(f"\n--- {path}\n{path.read_text()[-3000:]}" for path in sorted(tmp_path.glob("task-*.out")))

    # each task's own state (squeue's listing is empty too while slurmctld is too busy to answer, on a loaded host)
    for task in range(3):
        slurm.wait(f"{array}_{task}", describe=task_outputs)
    for gate in ("basis", "scalar"):
        save = tmp_path / "runs" / f"ablations-{array}" / f"{gate}_gate" / "checkpoints"
        assert [r["step"] for r in metrics_if_any(save) if r.get("event") == "final"] == [4], \
            job_log(save.parent) + task_outputs()
        info = json.loads((save / "iter_0000004" / "fe_run.json").read_text())
        assert info["config"]["memory"]["gate"] == gate
    assert "array task 2, but the list has 2 configs (0-1)" in (tmp_path / "task-2.out").read_text()
