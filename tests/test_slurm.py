"""The launch scripts under a real one-node SLURM: a job runs to completion, and a job sent
SIGUSR1 mid-run saves, requeues itself and ends on the uninterrupted job's losses.

The module starts its own munged, slurmctld and slurmd (Debian's slurm-wlm and munge, which
.ci/run installs) on private ports, and stops them at the end.  It skips, saying why, where
SLURM is not installed or the tests do not run as root."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.test_operations import final_curve, metrics_if_any
from tests.test_train import CONFIG, ROOT, metrics, small_overrides

pytestmark = pytest.mark.distributed
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")


def _why_no_slurm():
    missing = [name for name in DAEMONS if shutil.which(name) is None and not os.path.exists(f"/usr/sbin/{name}")]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): .ci/run installs slurm-wlm and munge "
                "with apt-get")
    if os.geteuid() != 0:
        return "starting munged and slurmd needs root"
    return None


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_munge():
    """munged as user munge (Debian's package makes the key); kept if one already answers."""
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return None
    for folder in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        os.makedirs(folder, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    os.chmod("/run/munge", 0o755)
    subprocess.run(["runuser", "-u", "munge", "--", shutil.which("munged") or "/usr/sbin/munged"], check=True)
    for _ in range(50):
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return True
        time.sleep(0.1)
    raise RuntimeError("munged started but does not answer")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _why_no_slurm()
    if why:
        pytest.skip(why)
    home = tmp_path_factory.mktemp("slurm")
    for name in ("state", "spool"):
        (home / name).mkdir()
    host = socket.gethostname()
    conf = home / "slurm.conf"
    conf.write_text(f"""ClusterName=fe-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
StateSaveLocation={home}/state
SlurmdSpoolDir={home}/spool
SlurmctldPidFile={home}/slurmctld.pid
SlurmdPidFile={home}/slurmd.pid
SlurmctldLogFile={home}/slurmctld.log
SlurmdLogFile={home}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=localhost NodeHostname={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
    env = dict(os.environ, SLURM_CONF=str(conf))
    started_munge = _start_munge()
    daemons = [subprocess.Popen([shutil.which(name) or f"/usr/sbin/{name}", "-D", "-f", str(conf)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for name in ("slurmctld", "slurmd")]
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the test SLURM did not come up (node state {state!r}); logs in {home}")
        yield env
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=30)
        if started_munge:
            subprocess.run(["pkill", "-x", "munged"])


def sbatch(env, run_dir, data, *extra, steps=16):
    """Submit launch_scripts/slurm/pretrain.sbatch with DP=2 on CPU; returns the job id."""
    overrides = small_overrides(data, **{"training.train_steps": steps, "training.log_interval": 1,
                                         "training.save_interval": 8}, **dict(x.split("=", 1) for x in extra))
    job_env = dict(env, CONFIG=CONFIG, RUN_DIR=str(run_dir), NPROC_PER_NODE="2", PYTHON=os.path.join(
        ROOT, ".venv", "bin", "python") if os.path.exists(os.path.join(ROOT, ".venv")) else "python3")
    job_env.pop("PYTHONWARNINGS", None)
    out = subprocess.run(["sbatch", "--parsable", f"--output={run_dir}.out", "launch_scripts/slurm/pretrain.sbatch",
                          *overrides], capture_output=True, text=True, env=job_env, cwd=ROOT, check=True).stdout
    return out.strip().split(";")[0]


def job_state(env, job):
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return fields.get("JobState"), int(fields.get("Restarts", 0))


def wait_for(env, job, run_dir, timeout=900):
    deadline = time.time() + timeout
    requeued_at = None
    while time.time() < deadline:
        state, restarts = job_state(env, job)
        if state == "PENDING" and restarts > 0:
            # SLURM holds a requeued job back for about two minutes; the test need not wait that
            # long, but a start in the same second as the requeue fails ("Job credential revoked":
            # slurmd revokes the old run's credential with one-second resolution)
            requeued_at = requeued_at or time.time()
            if time.time() - requeued_at > 3:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return state, restarts
        time.sleep(1)
    subprocess.run(["scancel", job], env=env)
    pytest.fail(f"job {job} still {state} after {timeout} s; its log: {_log(run_dir)}")


def _log(run_dir):
    text = ""
    for path in [f"{run_dir}.out"] + sorted(str(p) for p in (run_dir / "logs").glob("*.log")):
        if os.path.exists(path):
            text += f"\n--- {path}\n" + open(path).read()[-3000:]
    return text


@pytest.fixture(scope="module")
def uninterrupted_job(slurm, small_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("jobs") / "full"
    job = sbatch(slurm, run_dir, small_data)
    return job, run_dir, wait_for(slurm, job, run_dir)


def test_a_job_runs_to_completion(uninterrupted_job):
    job, run_dir, (state, restarts) = uninterrupted_job
    assert (state, restarts) == ("COMPLETED", 0), _log(run_dir)
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
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True)
    state, restarts = wait_for(slurm, job, run_dir)
    assert (state, restarts) == ("COMPLETED", 1), _log(run_dir)
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
    job_env = dict(slurm, ABLATION_CONFIGS=" ".join(configs), RUN_DIR_ROOT=str(tmp_path / "runs"), NPROC_PER_NODE="1",
                   PYTHON=sys.executable)
    job_env.pop("PYTHONWARNINGS", None)
    array = subprocess.run(["sbatch", "--parsable", "--array=0-2", f"--output={tmp_path}/task-%a.out",
                            "launch_scripts/slurm/ablations.sbatch", *overrides], capture_output=True, text=True,
                           env=job_env, cwd=ROOT, check=True).stdout.strip().split(";")[0]
    deadline = time.time() + 600
    while time.time() < deadline and subprocess.run(["squeue", "-h", "-j", array], capture_output=True, text=True,
                                                    env=slurm).stdout.strip():
        time.sleep(1)
    for gate in ("basis", "scalar"):
        save = tmp_path / "runs" / f"ablations-{array}" / f"{gate}_gate" / "checkpoints"
        assert [r["step"] for r in metrics_if_any(save) if r.get("event") == "final"] == [4], _log(save.parent)
        info = json.loads((save / "iter_0000004" / "fe_run.json").read_text())
        assert info["config"]["memory"]["gate"] == gate
    assert "array task 2, but the list has 2 configs (0-1)" in (tmp_path / "task-2.out").read_text()
