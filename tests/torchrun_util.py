import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 600, env: dict = None):
    """Run ``tests/distributed/<script>`` under torchrun; fail with its output on a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "tests", "distributed", script), *args]
    run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env, cwd=ROOT)
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if "FAIL" in line or "Error" in line or "checks" in line]
    assert proc.returncode == 0, "\n".join(lines[-40:]) or output[-4000:]
    return output
