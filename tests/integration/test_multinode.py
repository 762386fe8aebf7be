"""Many nodes: the launch scripts across the hosts of a test cluster (`tests/helpers/cluster.py`: network
namespaces with their own hostnames and addresses, one slurmd each).

- `pretrain.sbatch --nodes=2`, with the tables' rows exchanged across hosts and with TP=2 inside
  each node, ends on the losses of the same layout in one process group on one host, and its
  traffic crosses the nodes' interfaces;
- a node that hangs in the middle of a save and drops off the network: the survivors stop after
  the collective timeout, the previous checkpoint stays the newest complete one, SLURM requeues
  the job onto the healthy nodes and it ends on the uninterrupted run's losses;
- a 2-node checkpoint resumes on 1 node, its row-sharded tables regathered, in both engines;
- node-shared tables on 2 nodes of 2 ranks (one segment per node, rows exchanged only between the
  nodes) end on the losses of row-sharded tables over 4 ranks on one host;
- `launch_scripts/torchrun.sh` across 2 hosts without SLURM (c10d rendezvous): a killed worker
  is restarted by ``MAX_RESTARTS`` and the run ends on the uninterrupted losses.

The tests skip, saying why, without root, SLURM or network namespaces.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from fe_megatron.checkpoint.files import complete_iterations, read_tracker, write_tracker
from tests.helpers.cluster import Cluster, job_log, why_no_cluster
from tests.helpers.torchrun_util import clean_environment
from tests.helpers.training import CONFIG, ROOT, final_curve, metrics_if_any, run_pretrain, small_overrides

pytestmark = pytest.mark.distributed

STEPS = 12
# the collective timeout of the healthy jobs: above any start-up skew on two busy cores
TIMEOUT_MINUTES = 2
# and of the job that loses a node: a lost peer is noticed after 12 s
LOST_NODE_TIMEOUT_MINUTES = 0.2
ROWS = {"parallel.table_sharding": "rows"}
HOST_TABLES = {"memory.table_placement": "host"}
DEEPSPEED = {"training.engine": "deepspeed", "parallel.table_sharding": "rows", "optimizer.clip_grad": 0.0,
             "deepspeed": "{zero_optimization: {stage: 3}}"}


def overrides(data, steps=STEPS, **extra):
    values = {"training.train_steps": steps, "training.log_interval": 1, "training.eval_interval": 4,
              "training.eval_steps": 1, "training.save_interval": 4,
              "parallel.distributed_timeout_minutes": TIMEOUT_MINUTES}
    values.update(extra)
    return small_overrides(data, **values)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = why_no_cluster()
    if why:
        pytest.skip(why)
    with Cluster(tmp_path_factory.mktemp("cluster"), nodes=3) as test_cluster:
        yield test_cluster


def job_environment(**extra):
    return clean_environment(CONFIG=CONFIG, PYTHON=sys.executable, **extra)


def submit(cluster, run_dir, data, nodes=2, per_node=1, env=None, steps=STEPS, **extra):
    """``sbatch --nodes=NODES launch_scripts/slurm/pretrain.sbatch`` with the small config; the job id."""
    return cluster.sbatch([f"--nodes={nodes}", f"--output={run_dir}.out", "launch_scripts/slurm/pretrain.sbatch",
                           *overrides(data, steps, **extra)],
                          env=job_environment(RUN_DIR=str(run_dir), NPROC_PER_NODE=str(per_node), **(env or {})),
                          cwd=ROOT)


def run_job(cluster, run_dir, data, **kwargs):
    """Submit, wait for the end; the job's fields and the bytes each node's eth0 moved meanwhile."""
    before = {name: cluster.interface_bytes(name) for name in cluster.nodes}
    job = submit(cluster, run_dir, data, **kwargs)
    fields = cluster.wait(job, describe=lambda: job_log(run_dir))
    after = {name: cluster.interface_bytes(name) for name in cluster.nodes}
    moved = {name: {k: after[name][k] - before[name][k] for k in after[name]} for name in after}
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "0"), job_log(run_dir)
    return fields, moved


def one_host(run_dir, data, nproc, **extra):
    """The same layout in one process group on one host (torchrun --standalone)."""
    run_pretrain(["--config", CONFIG, "--save", str(run_dir)] + overrides(data, **extra), nproc=nproc)
    return str(run_dir)


def hosts_line(run_dir):
    """The trainer's report of where its ranks run ("process group: 2 ranks on 2 hosts: ...")."""
    lines = [line for line in job_log(run_dir).splitlines() if "process group:" in line]
    assert lines, job_log(run_dir)
    return lines[-1]


def rank_hosts(run_dir):
    """{rank: (host, address)} from the trainer's report of where its ranks run."""
    placement = {}
    for host, address, ranks in re.findall(r"(node\d+) (\S+) \(ranks? ([\d,-]+)\)", hosts_line(run_dir)):
        first, _, last = ranks.partition("-")
        for rank in (range(int(first), int(last) + 1) if last else map(int, ranks.split(","))):
            placement[rank] = (host, address)
    return placement


def trainers(cluster, name):
    """fe-pretrain's worker processes on node ``name`` (not torchrun's agent, nor a process a worker forked,
    which carries the worker's command line for as long as it runs)."""
    import psutil

    found = {}
    for pid in cluster.pids(name):
        try:
            process = psutil.Process(pid)
            cmdline, parent = " ".join(process.cmdline()), process.ppid()
        except psutil.Error:
            continue
        if "fe_megatron.train" in cmdline and "torch.distributed.run" not in cmdline:
            found[pid] = parent
    return [pid for pid, parent in found.items() if parent not in found]


@pytest.fixture(scope="module")
def rows_on_one_host(small_data, tmp_path_factory):
    return one_host(tmp_path_factory.mktemp("one_host") / "rows", small_data, 2, **ROWS)


@pytest.fixture(scope="module")
def rows_on_two_nodes(cluster, small_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("jobs") / "rows"
    started = time.time()
    fields, moved = run_job(cluster, run_dir, small_data, **ROWS)
    return {"dir": run_dir, "fields": fields, "moved": moved, "seconds": time.time() - started}


def test_row_sharded_tables_across_two_nodes_match_one_host(cluster, rows_on_two_nodes, rows_on_one_host):
    job = rows_on_two_nodes
    # the workers report their hosts and addresses: the namespaces' interfaces, not loopback
    placement = rank_hosts(job["dir"])
    assert sorted(host for host, _ in placement.values()) == cluster.hostnames(job["fields"]["NodeList"])
    assert all(address == cluster.nodes[host].address for host, address in placement.values()), placement
    assert hosts_line(job["dir"]).endswith(f"collectives time out after {TIMEOUT_MINUTES:g} min "
                                           "(parallel.distributed_timeout_minutes)")
    # and the all-to-all of table rows and the gradient all-reduce crossed the cable, both ways
    for host, _ in placement.values():
        moved = job["moved"][host]
        assert min(moved["eth0_rx"], moved["eth0_tx"]) > 1_000_000, job["moved"]
    assert final_curve(job["dir"] / "checkpoints") == final_curve(rows_on_one_host)
    print(f"rows, 2 nodes x 1 worker: {job['seconds']:.0f} s; bytes on eth0: {job['moved']}")


def test_node_shared_tables_on_two_nodes_of_two_ranks_match_row_sharded_ones_on_one_host(cluster, small_data,
                                                                                        tmp_path):
    from fe_megatron.tables.node_shared import PREFIX

    steps = 6
    reference = one_host(tmp_path / "one_host", small_data, 4, steps=steps, **ROWS, **HOST_TABLES)
    run_dir = tmp_path / "node"
    before = {name for name in os.listdir("/dev/shm") if name.startswith(PREFIX)}
    started = time.time()
    _, moved = run_job(cluster, run_dir, small_data, per_node=2, steps=steps, **HOST_TABLES,
                       **{"parallel.table_sharding": "node"})
    placement = rank_hosts(run_dir)
    assert placement[0] == placement[1] and placement[2] == placement[3] and placement[0] != placement[2]
    assert "in shared host memory (/dev/shm), one copy per node" in job_log(run_dir)
    for host, _ in set(placement.values()):  # the rows of the other node's ranks crossed the cable
        assert min(moved[host]["eth0_rx"], moved[host]["eth0_tx"]) > 100_000, moved
    assert final_curve(run_dir / "checkpoints") == final_curve(reference)
    assert {name for name in os.listdir("/dev/shm") if name.startswith(PREFIX)} <= before  # nothing left
    print(f"node-shared, 2 nodes x 2 workers: {time.time() - started:.0f} s; bytes on eth0: {moved}")


def test_tensor_parallel_inside_each_node_matches_one_host(cluster, small_data, tmp_path):
    steps = 4
    reference = one_host(tmp_path / "one_host", small_data, 4, steps=steps, **{"parallel.tensor": 2})
    run_dir = tmp_path / "tp2"
    run_job(cluster, run_dir, small_data, per_node=2, steps=steps, **{"parallel.tensor": 2})
    placement = rank_hosts(run_dir)
    # a tensor-parallel pair (ranks 0-1, 2-3) shares a node; data parallelism crosses the nodes
    assert placement[0] == placement[1] and placement[2] == placement[3] and placement[0] != placement[2]
    assert final_curve(run_dir / "checkpoints") == final_curve(reference)


def test_a_node_lost_during_a_save_is_requeued_and_ends_on_the_uninterrupted_losses(cluster, small_data,
                                                                                   rows_on_one_host, tmp_path):
    run_dir = tmp_path / "lost"
    checkpoints = run_dir / "checkpoints"
    # rank 1 writes its part of checkpoint 8, then stops answering: a host hung mid-save
    job = submit(cluster, run_dir, small_data, env={"FE_MEGATRON_FAULTS": "hang_during_save@8:1"},
                 **ROWS, **{"parallel.distributed_timeout_minutes": LOST_NODE_TIMEOUT_MINUTES})
    lost = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not any(r.get("step", 0) >= 1 for r in metrics_if_any(checkpoints)):
            time.sleep(0.2)
        placement = rank_hosts(run_dir)
        (first, _), (lost, _) = placement[0], placement[1]
        survivors = trainers(cluster, first)
        assert len(survivors) == 1, job_log(run_dir)
        while time.time() < deadline and "stops answering" not in job_log(run_dir):
            time.sleep(0.2)
        assert "stops answering" in job_log(run_dir), job_log(run_dir)
        cluster.cut_link(lost)  # ... and drops off the network
        cut = time.time()

        # the survivor waits in its collective until the timeout, then fails (not after 30 minutes)
        while time.time() < cut + 120 and survivors[0] in trainers(cluster, first):
            time.sleep(0.2)
        survivor_stopped = time.time() - cut
        assert survivor_stopped < LOST_NODE_TIMEOUT_MINUTES * 60 + 15, job_log(run_dir)
        # the checkpoint being written is not complete and nothing says it is: the tracker names step 4
        assert read_tracker(str(checkpoints)) == 4 and complete_iterations(str(checkpoints)) == [4]
        assert (checkpoints / "iter_0000008.tmp").is_dir() and not (checkpoints / "iter_0000008").exists()

        # SLURM notices the silent node, marks it down and requeues the job
        requeued = cluster.wait(job, until=("PENDING",), timeout=120, describe=lambda: job_log(run_dir))
        job_requeued = time.time() - cut
        assert int(requeued["Restarts"]) == 1
        assert cluster.node_states()[lost].startswith("down")
        cluster.kill_node(lost)  # fenced: what is left of it never writes again

        fields = cluster.wait(job, describe=lambda: job_log(run_dir))
        assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), job_log(run_dir)
        assert lost not in cluster.hostnames(fields["NodeList"])
        log = job_log(run_dir)
        assert "(restart 1)" in log and "at iteration 4" in log
        assert final_curve(checkpoints) == final_curve(rows_on_one_host)
        print(f"node lost: survivor stopped {survivor_stopped:.1f} s after the cut, job requeued after "
              f"{job_requeued:.1f} s")
    finally:  # leave the cluster whole for the next test, whatever happened
        subprocess.run(["scancel", job], env=cluster.env, capture_output=True)
        if lost is not None:
            cluster.kill_node(lost)
            cluster.restore_link(lost)
            cluster.start_slurmd(lost)
            cluster.wait_for_nodes("idle")


def checkpoint_copy(source, target, step, deepspeed=False):
    """``target`` holding ``source``'s checkpoint ``step`` as its newest: what a run stopped there leaves."""
    os.makedirs(target)
    name = f"iter_{step:07d}"
    shutil.copytree(os.path.join(source, name), os.path.join(target, name))
    shutil.copyfile(os.path.join(source, "metrics.jsonl"), os.path.join(target, "metrics.jsonl"))
    if deepspeed:
        from fe_megatron.deepspeed.engine import write_deepspeed_latest

        write_deepspeed_latest(str(target), os.path.join(target, name))
    write_tracker(str(target), step)


def resume_on_one_node(cluster, data, source, run_dir, **extra):
    """The 2-node run's checkpoint 8 continued by a 1-node, 1-worker job to the end."""
    checkpoint_copy(str(source), str(run_dir / "checkpoints"), 8, deepspeed=extra.get("training.engine") == "deepspeed")
    run_job(cluster, run_dir, data, nodes=1, **extra)
    assert "at iteration 8" in job_log(run_dir)
    return final_curve(run_dir / "checkpoints")


def assert_close_curves(got, expected, rel=2e-5):
    """Steps 9-12 of a DP=1 continuation against the DP=2 run: equal to fp32 rounding (the gradient
    sums are added in another order)."""
    for step in range(9, STEPS + 1):
        for index, value in expected[step].items():
            assert got[step][index] == pytest.approx(value, rel=rel, abs=1e-7), f"step {step}, value {index}"


def test_a_two_node_checkpoint_resumes_on_one_node(cluster, small_data, rows_on_two_nodes, tmp_path):
    source = rows_on_two_nodes["dir"] / "checkpoints"
    got = resume_on_one_node(cluster, small_data, source, tmp_path / "one_node", **ROWS)
    assert_close_curves(got, final_curve(source))


@pytest.fixture(scope="module")
def deepspeed_on_one_host(small_data, tmp_path_factory):
    pytest.importorskip("deepspeed", reason="DeepSpeed is installed by the project's set-up (make setup)")
    return one_host(tmp_path_factory.mktemp("one_host") / "deepspeed", small_data, 2, **DEEPSPEED)


@pytest.fixture(scope="module")
def torchrun_across_two_hosts(cluster, small_data, deepspeed_on_one_host, tmp_path_factory):
    """launch_scripts/torchrun.sh on node1 and node2 (no SLURM), the DeepSpeed engine with row-sharded
    tables; node2's worker is killed after step 5 and MAX_RESTARTS=1 brings the group back."""
    run_dir = tmp_path_factory.mktemp("torchrun") / "run"
    save = str(run_dir / "checkpoints")
    env = job_environment(NNODES="2", NPROC_PER_NODE="1", MAX_RESTARTS="1", RDZV_ENDPOINT="node1:29400",
                          RDZV_ID="fe-test")
    cmd = ["bash", "launch_scripts/torchrun.sh", "--config", CONFIG, "--save", save, "--load", save] + \
        overrides(small_data, **DEEPSPEED)
    os.makedirs(run_dir / "logs")
    launchers, logs = {}, []
    try:
        for name in ("node1", "node2"):
            logs.append(open(run_dir / "logs" / f"{name}.log", "w"))
            launchers[name] = cluster.run_on(name, cmd, stdout=logs[-1], stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.time() + 300
        while time.time() < deadline and not any(r.get("step", 0) >= 5 for r in metrics_if_any(save)):
            time.sleep(0.2)
        killed = trainers(cluster, "node2")
        assert len(killed) == 1, job_log(run_dir)
        os.kill(killed[0], signal.SIGKILL)
        codes = {name: launcher.wait(timeout=600) for name, launcher in launchers.items()}
    finally:
        for launcher in launchers.values():
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    assert codes == {"node1": 0, "node2": 0}, job_log(run_dir)
    return run_dir


def test_torchrun_across_hosts_restarts_a_killed_worker(torchrun_across_two_hosts, deepspeed_on_one_host):
    run_dir = torchrun_across_two_hosts
    log = job_log(run_dir)
    assert {host for host, _ in rank_hosts(run_dir).values()} == {"node1", "node2"}
    # the restarted group resumed from the newest checkpoint before the kill (step 4, or 8 when the
    # kill came late) and met again without reading the dead workers' addresses
    assert re.search(r"resumed from .* at iteration (4|8)", log) and "connectFullMesh" not in log
    assert final_curve(run_dir / "checkpoints") == final_curve(deepspeed_on_one_host)


def test_a_two_node_deepspeed_checkpoint_resumes_on_one_node(cluster, small_data, torchrun_across_two_hosts,
                                                             tmp_path):
    source = torchrun_across_two_hosts / "checkpoints"
    got = resume_on_one_node(cluster, small_data, source, tmp_path / "one_node", **DEEPSPEED)
    assert "saved by 2 data-parallel ranks" in job_log(tmp_path / "one_node")
    assert_close_curves(got, final_curve(source))
