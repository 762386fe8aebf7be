"""Launching processes from a test: a script of ``tests/distributed/`` under torchrun, and any command
in a session of its own with a clean launcher environment."""

import os
import re
import signal
import subprocess
import sys

from tests.helpers.paths import DISTRIBUTED, ROOT


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 600, env: dict = None):
    """Run ``tests/distributed/<script>`` under torchrun; fail with its output on a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(DISTRIBUTED, script), *args]
    run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env, cwd=ROOT)
    output = proc.stdout + proc.stderr
    # the checks' verdicts, errors, and how each failed rank ended (exit code, signal: a rank can fail
    # after every check passed)
    keys = ("FAIL", "Error", "checks", "exitcode", "Signal", "rank      :")
    lines = [line for line in output.splitlines() if any(key in line for key in keys)]
    assert proc.returncode == 0, "\n".join(lines[-40:]) + "\n" + crash_digest(output) + \
        "\n--- last output ---\n" + output[-1500:]
    return output


CHECKS_LINE = re.compile(r"^(\d+) checks on rank 0, (\d+) failures over all ranks$", re.MULTILINE)


def every_check_passed(output: str) -> int:
    """The number of checks rank 0 made, from the one summary line a `tests/distributed/common.Checker` prints;
    fails unless that line is there once, with no failure over all ranks and at least one check made."""
    found = CHECKS_LINE.findall(output)
    assert len(found) == 1, f"expected one '<N> checks on rank 0, <F> failures over all ranks' line, found " \
                            f"{len(found)}:\n{output[-1500:]}"
    checks, failures = (int(number) for number in found[0])
    assert failures == 0 and checks > 0, f"{checks} checks on rank 0, {failures} failures:\n{output[-3000:]}"
    return checks


def crash_digest(output: str, lines_per_crash: int = 40) -> str:
    """Where each process that died of a signal was: faulthandler's "Fatal Python error" line and the stack of
    the thread it names ("Current thread", innermost call first), for every crash in ``output``; empty if none.
    A crash's other threads (every one is dumped) would crowd it out of a failure message's tail."""
    digests, lines = [], output.splitlines()
    for start, line in enumerate(lines):
        if not line.startswith("Fatal Python error"):
            continue
        block = [line]
        current = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("Current thread")), None)
        if current is not None:
            end = next((i for i in range(current + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
            block += lines[current:min(end, current + lines_per_crash)]
        digests.append("\n".join(block))
    return "\n".join(["--- where each crashed process was ---", *digests]) if digests else ""


def failed_launch(proc: subprocess.CompletedProcess, stdout_tail: int = 3000, stderr_tail: int = 3000) -> str:
    """A failed launch's assertion message: where each crashed process was (`crash_digest`), then the ends of
    its output."""
    return (crash_digest(proc.stderr) + "\n--- last output ---\n" + proc.stdout[-stdout_tail:]
            + proc.stderr[-stderr_tail:])


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_RESTART_COUNT",
                      "TORCHELASTIC_RESTART_COUNT")


def clean_environment(**extra: str) -> dict:
    """The test's environment for a command that starts its own processes: without the launcher
    variables, PYTHONWARNINGS or Transformer Engine's attention choices (NVTE_*: megatron.training's
    argument validation sets them in the process that validates, and checks them against
    --attention-backend in the next) the test process may carry, one thread per process, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES + ("PYTHONWARNINGS",) and not k.startswith("NVTE_")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run_in_own_session(cmd: list, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root in a session of its own, so that a timeout kills torchrun's
    workers too (not only torchrun); its output is captured."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                          start_new_session=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            raise AssertionError(f"{' '.join(cmd[:6])} ran past {timeout} s:\n{stdout[-3000:]}{stderr[-3000:]}") \
                from None
    return subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)


def megatron_logits(run: str, tokens, tp: int, tmp_path):
    """The logits of ``run``'s Megatron model on ``tokens`` (tests/distributed/megatron_logits.py at ``tp``
    processes), read back as a tensor."""
    import torch

    torch.save(tokens, tmp_path / "tokens.pt")
    torchrun("megatron_logits.py", run, str(tmp_path / "tokens.pt"), str(tmp_path / "logits.pt"), nproc=tp)
    return torch.load(tmp_path / "logits.pt")
