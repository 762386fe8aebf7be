"""Other work on the host while a benchmark measures: ``--busy-cores N`` in the benchmarks that take it."""

import contextlib
import subprocess
import sys
import time


@contextlib.contextmanager
def busy_cores(count: int):
    """``count`` processes, each keeping one core busy until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5 if count else 0)  # the spinners are running before the timing starts
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
