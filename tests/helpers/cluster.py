"""A small SLURM cluster on one machine, for tests: each node is a host of its own.

Each node is a Linux network namespace with its own hostname (a UTS namespace), its own
interface ``eth0`` and address, joined to the other nodes by a veth pair and a bridge.  Names
resolve through ``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over
``/etc/hosts``.  One ``munged`` and one ``slurmctld`` run in the test's own namespace, on the
bridge's address.  Each node runs its own ``slurmd``.  The file system is shared, as a cluster's
parallel file system would be.

    with Cluster(tmp_path, nodes=3) as cluster:
        job = cluster.sbatch(["launch_scripts/slurm/pretrain.sbatch", ...], nodes=2, env={...})
        cluster.wait(job)
        cluster.cut_link("node2")               # the node drops off the network
        cluster.run_on("node1", ["bash", ...])  # a command on a node, outside SLURM

Nothing leaves the test's namespaces: the nodes' subnet is private (a free 10.213.x.0/24) and the
bridge has no uplink.  `why_no_cluster` says why a machine cannot host one (not root, no
SLURM, no network namespaces); the tests skip with that reason.  Every namespace, interface and
daemon is removed on exit, also after a failure.  The daemons' logs stay in ``home``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Dict, List, Optional

SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
SLURMD_TIMEOUT_S = 20  # a node silent for this long is DOWN and its jobs are requeued (SLURM: 300)
SCONTROL_TIMEOUT_S = 15  # one `scontrol show job` (its MessageTimeout, 5 s, is per message)
NO_STATE_LIMIT_S = 45  # a wait that reads no state of its job for this long fails, saying what it saw
END_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)


def _run(*cmd: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, **kwargs)


def why_no_cluster() -> Optional[str]:
    """None when this machine can host a test cluster; otherwise why not, and what would help."""
    missing = [name for name in SLURM_PROGRAMS if _which(name) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): .ci/run installs slurm-wlm and munge "
                "with apt-get")
    if os.geteuid() != 0:
        return "starting munged and slurmd, and making network namespaces, needs root"
    if _which("ip") is None or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return ("the test hosts need iproute2's ip and util-linux's unshare and nsenter: .ci/run installs iproute2 "
                "with apt-get")
    probe = f"feprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces are not available here (ip netns add: {made.stderr.strip()})"
    _run("ip", "netns", "delete", probe, check=False)
    return None


def _free_subnet() -> str:
    """``10.213.x`` for the first x whose /24 no interface of this machine uses."""
    used = _run("ip", "-4", "-o", "addr", check=False).stdout
    for x in range(16, 250):
        if f" 10.213.{x}." not in used:
            return f"10.213.{x}"
    raise RuntimeError("no free 10.213.x.0/24 subnet for the test cluster")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Node:
    """One host: a network namespace ``namespace`` whose ``eth0`` has ``address``; ``veth`` is the
    other end of its cable, on the bridge."""

    def __init__(self, name: str, namespace: str, address: str, veth: str):
        self.name, self.namespace, self.address, self.veth = name, namespace, address, veth

    def command(self, cmd: List[str]) -> List[str]:
        """``cmd`` as run on this node: in its network namespace, with its hostname and its
        ``/etc/hosts`` (``ip netns exec`` would also remount /sys, hiding the cgroup file system
        slurmd needs)."""
        return ["nsenter", f"--net=/run/netns/{self.namespace}", "unshare", "--uts", "--mount", "--", "sh", "-c",
                'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"', self.name,
                f"/etc/netns/{self.namespace}/hosts", *cmd]


class Cluster:
    """A SLURM cluster of ``nodes`` hosts named node1, node2, ... in one partition ``test``; see the
    module's docstring.  ``cpus`` is what each node declares (they share this machine's cores)."""

    def __init__(self, home, nodes: int = 2, cpus: int = 2):
        self.home = str(home)
        self.cpus = cpus
        self.prefix = f"fe{os.getpid() % 100000}"
        self.subnet = _free_subnet()
        self.controller_address = f"{self.subnet}.1"
        self.bridge = f"{self.prefix}b"
        self.nodes: Dict[str, Node] = {}
        for i in range(1, nodes + 1):
            name = f"node{i}"
            self.nodes[name] = Node(name, f"{self.prefix}-{name}", f"{self.subnet}.{10 + i}", f"{self.prefix}v{i}")
        self.env = dict(os.environ, SLURM_CONF=os.path.join(self.home, "slurm.conf"))
        self._daemons: Dict[str, subprocess.Popen] = {}
        self._started_munge = False
        self.last_answer = ""  # what the last `scontrol show job` printed, for a wait's failure

    # --- start and stop -------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        try:
            self._make_network()
            self._write_config()
            self._start_munge()
            self._start_daemon("slurmctld", [_which("slurmctld"), "-D", "-f", self.env["SLURM_CONF"]])
            for node in self.nodes.values():
                self.start_slurmd(node.name)
            self.wait_for_nodes("idle")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for node in self.nodes.values():
            self.kill_node(node.name)
        for daemon in self._daemons.values():
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    daemon.kill()
        if self._started_munge:
            self._stop_munge()
        for node in self.nodes.values():
            _run("ip", "link", "delete", node.veth, check=False)
            _run("ip", "netns", "delete", node.namespace, check=False)
            shutil.rmtree(f"/etc/netns/{node.namespace}", ignore_errors=True)
        _run("ip", "link", "delete", self.bridge, check=False)

    def _make_network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.name}\n" for n in self.nodes.values())
        for node in self.nodes.values():
            _run("ip", "netns", "add", node.namespace)
            _run("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0", "netns", node.namespace)
            _run("ip", "link", "set", node.veth, "master", self.bridge)
            _run("ip", "link", "set", node.veth, "up")
            inside = ["ip", "netns", "exec", node.namespace]
            _run(*inside, "ip", "addr", "add", f"{node.address}/24", "dev", "eth0")
            _run(*inside, "ip", "link", "set", "eth0", "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{node.namespace}", exist_ok=True)
            with open(f"/etc/netns/{node.namespace}/hosts", "w") as fh:
                fh.write(hosts)

    def _write_config(self) -> None:
        for folder in ("state", "spool"):
            os.makedirs(os.path.join(self.home, folder), exist_ok=True)
        h = self.home
        nodes = "".join(f"NodeName={n.name} NodeHostname={n.name} NodeAddr={n.address} CPUs={self.cpus} "
                        "State=UNKNOWN\n" for n in self.nodes.values())
        with open(self.env["SLURM_CONF"], "w") as fh:
            fh.write(f"""ClusterName=fe-test
SlurmctldHost={socket.gethostname()}({self.controller_address})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
StateSaveLocation={h}/state
SlurmdSpoolDir={h}/spool/%n
SlurmctldPidFile={h}/slurmctld.pid
SlurmdPidFile={h}/slurmd-%n.pid
SlurmctldLogFile={h}/slurmctld.log
SlurmdLogFile={h}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
SlurmdTimeout={SLURMD_TIMEOUT_S}
MessageTimeout=5
KillWait=5
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/filetxt
JobCompLoc={h}/jobcomp.txt
AccountingStorageType=accounting_storage/none
{nodes}PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def _start_munge(self) -> None:
        """munged as user munge (Debian's package makes the key); kept if one already answers."""
        if _run("sh", "-c", "munge -n | unmunge", check=False).returncode == 0:
            return
        for folder in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
            os.makedirs(folder, exist_ok=True)
            shutil.chown(folder, "munge", "munge")
        os.chmod("/run/munge", 0o755)
        _run("runuser", "-u", "munge", "--", _which("munged"))
        self._started_munge = True
        for _ in range(50):
            if _run("sh", "-c", "munge -n | unmunge", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError("munged started but does not answer")

    @staticmethod
    def _stop_munge() -> None:
        """Stop the munged this cluster started (by its pid file, not by name)."""
        try:
            with open("/run/munge/munged.pid") as fh:
                os.kill(int(fh.read().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass

    def _start_daemon(self, key: str, cmd: List[str]) -> None:
        self._daemons[key] = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start_slurmd(self, name: str) -> None:
        """(Re)start ``name``'s slurmd on its host."""
        os.makedirs(os.path.join(self.home, "spool", name), exist_ok=True)
        self._start_daemon(f"slurmd-{name}", self.nodes[name].command(
            [_which("slurmd"), "-D", "-N", name, "-f", self.env["SLURM_CONF"]]))

    # --- what the tests do to nodes ---------------------------------------------------------------

    def run_on(self, name: str, cmd: List[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``cmd`` on node ``name`` (outside SLURM), in a session of its own."""
        return subprocess.Popen(self.nodes[name].command(cmd), start_new_session=True, **popen_kwargs)

    def cut_link(self, name: str) -> None:
        """Unplug ``name``'s cable: its processes live on, but no packet reaches or leaves it."""
        _run("ip", "link", "set", self.nodes[name].veth, "down")

    def restore_link(self, name: str) -> None:
        _run("ip", "link", "set", self.nodes[name].veth, "up")

    def pids(self, name: str) -> List[int]:
        """Every process running on node ``name``."""
        return [int(pid) for pid in _run("ip", "netns", "pids", self.nodes[name].namespace, check=False).stdout.split()]

    def kill_node(self, name: str, timeout: float = 30) -> None:
        """SIGKILL every process on ``name`` (its slurmd and whatever it started), until none is left:
        the host is gone."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            pids = self.pids(name)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        daemon = self._daemons.get(f"slurmd-{name}")
        if daemon is not None:
            daemon.wait(timeout=max(1.0, deadline - time.time()))

    def interface_bytes(self, name: str) -> Dict[str, int]:
        """Bytes received and sent so far on ``name``'s ``eth0`` and on its loopback interface."""
        out = _run("ip", "netns", "exec", self.nodes[name].namespace, "sh", "-c",
                   "cat /sys/class/net/eth0/statistics/rx_bytes /sys/class/net/eth0/statistics/tx_bytes "
                   "/sys/class/net/lo/statistics/rx_bytes /sys/class/net/lo/statistics/tx_bytes").stdout.split()
        return dict(zip(("eth0_rx", "eth0_tx", "lo_rx", "lo_tx"), map(int, out)))

    # --- SLURM --------------------------------------------------------------------------------------

    def node_states(self) -> Dict[str, str]:
        out = _run("sinfo", "-h", "-N", "-o", "%N %t", env=self.env, check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_for_nodes(self, state: str, names=None, timeout: float = 60) -> None:
        """Until every node of ``names`` (default all) is in ``state`` (sinfo's short form: idle, down*, ...)."""
        names = list(names or self.nodes)
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = self.node_states()
            if all(states.get(n, "").rstrip("*~#") == state.rstrip("*~#") for n in names):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the test cluster's nodes are {self.node_states()}, not all {state}, after {timeout} s; "
                           f"logs in {self.home}")

    def sbatch(self, args: List[str], env: Dict[str, str], cwd: str) -> str:
        """Submit a batch job (``args`` as after ``sbatch --parsable``) with environment ``env``,
        which the job inherits (plus this cluster's SLURM_CONF); returns its id."""
        proc = _run(_which("sbatch"), "--parsable", *args, env=dict(env, SLURM_CONF=self.env["SLURM_CONF"]), cwd=cwd,
                    check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def hostnames(self, nodelist: str) -> List[str]:
        """The node names of a SLURM node list ("node[1-2]" -> ["node1", "node2"])."""
        return _run("scontrol", "show", "hostnames", nodelist, env=self.env).stdout.split()

    def job(self, job: str) -> Dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, NodeList, ...); when the controller knows
        no such job (slurmctld forgets a job MinJobAge, 300 s, after its end) or does not answer, the
        accounting's record of its last end (`ended`); {} when neither has it."""
        try:
            proc = _run("scontrol", "show", "job", job, env=self.env, check=False, timeout=SCONTROL_TIMEOUT_S)
            out, self.last_answer = proc.stdout, (proc.stderr.strip() or proc.stdout.strip())[:300]
        except subprocess.TimeoutExpired:
            out, self.last_answer = "", f"scontrol show job {job} did not answer in {SCONTROL_TIMEOUT_S} s"
        fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
        return fields if fields.get("JobState") else self.ended(job)

    def ended(self, job: str) -> Dict[str, str]:
        """The job's last end in slurmctld's accounting (`accounted_end` of ``jobcomp.txt``)."""
        return accounted_end(os.path.join(self.home, "jobcomp.txt"), job)

    def controller_state(self) -> str:
        """Whether slurmctld runs, and the end of its log: what a wait that read no state saw."""
        daemon = self._daemons.get("slurmctld")
        code = daemon.poll() if daemon is not None else "never started"
        path = os.path.join(self.home, "slurmctld.log")
        log = "".join(open(path).readlines()[-15:]) if os.path.exists(path) else "(no log)"
        return f"slurmctld {'runs' if code is None else f'exited: {code}'}; the end of {path}:\n{log}"

    def wait(self, job: str, timeout: float = 600, until=END_STATES, describe=lambda: "") -> Dict[str, str]:
        """Wait for ``job`` to reach a state in ``until``; returns its fields.  A requeued job is let
        start at once: SLURM would hold it back for about two minutes, but a start in the same second
        as the requeue fails ("Job credential revoked": slurmd revokes credentials per second).  Neither
        the controller nor the accounting knowing the job for `NO_STATE_LIMIT_S` fails the wait at once,
        with what scontrol said and the controller's state, rather than after ``timeout``."""
        deadline = time.time() + timeout
        requeued_at = None
        fields, known_at = {}, time.time()
        while time.time() < deadline:
            fields = self.job(job)
            if fields.get("JobState"):
                known_at = time.time()
            elif time.time() - known_at > NO_STATE_LIMIT_S:
                _run("scancel", job, env=self.env, check=False)
                raise AssertionError(f"job {job}: no state for {NO_STATE_LIMIT_S} s, neither from scontrol (its "
                                     f"last answer: {self.last_answer!r}) nor from the accounting "
                                     f"({self.home}/jobcomp.txt); {self.controller_state()}{describe()}")
            if fields.get("JobState") == "PENDING" and int(fields.get("Restarts", 0)) > 0:
                requeued_at = requeued_at or time.time()
                if time.time() - requeued_at > 3:
                    _run("scontrol", "update", f"JobId={job}", "StartTime=now", env=self.env, check=False)
            if fields.get("JobState") in until:
                return fields
            time.sleep(0.5)
        _run("scancel", job, env=self.env, check=False)
        raise AssertionError(f"job {job} still {fields.get('JobState')} after {timeout} s{describe()}")


def accounted_end(path: str, job: str) -> Dict[str, str]:
    """The last end of ``job`` (a job id, or an array task's ``ARRAY_TASK``) in the accounting file ``path``
    (jobcomp/filetxt: one record per end, a requeue included, which it records as PENDING), with ``Restarts``:
    the ends before it; {} if it has none."""
    records = []
    if os.path.exists(path):
        for line in open(path):
            fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
            if job in (fields.get("JobId"), f"{fields.get('ArrayJobId')}_{fields.get('ArrayTaskId')}"):
                records.append(fields)
    return dict(records[-1], Restarts=str(len(records) - 1)) if records else {}


def job_log(run_dir):
    """The end of a pretrain.sbatch job's log and of each node's log (RUN_DIR.out, RUN_DIR/logs/)."""
    text = ""
    for path in [f"{run_dir}.out"] + sorted(str(p) for p in (run_dir / "logs").glob("*.log")):
        if os.path.exists(path):
            text += f"\n--- {path}\n" + open(path).read()[-4000:]
    return text
