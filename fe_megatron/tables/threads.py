"""How many intra-op threads the tables' work on host CPUs uses: chosen by measurement, per kind of work.

The host tier's rows (and every table of a CPU run) are gathered, reduced and updated by host CPUs,
which a real job shares with data loaders, other ranks and other processes.  torch runs each operator
on all its intra-op threads, splitting the work evenly (OpenMP's static schedule) and waiting at the
end for the slowest part.  When a thread has no free core it waits for a scheduler slice, and the
table step is many short operators (a gather, a sort, sums per row, index reads and writes), each of
which then waits: on a 2-core host with one core busy, the demo's table step ran 6x slower at two
threads than at one (benchmarks/RESULTS.md, "busy host").

`ThreadChoice` picks, for one kind of work, between one thread and torch's count:

* work below `SMALL_WORK` elements runs on one thread (torch's own operators do not split it either);
* larger work runs at the count whose measured time per element is lower, each count's time an
  exponential average of its runs.  The other count is tried again after `FIRST_PROBE` runs, and
  after twice as many each time it loses again (up to `LAST_PROBE`), so the choice follows the
  host's load as it changes while a losing count costs few runs.

The thread count changes no result: the table kernels' reductions run in a fixed order whatever the
threads (`fe_megatron.ops`), and torch's gathers, copies and row-wise sums are element-wise per row.
Only work on CPU tensors, in the main thread, is affected: a GPU's work is not, nor the host tier's
worker thread's (torch's thread count is the process's to set, so only the main thread changes it).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

SMALL_WORK = 1 << 15  # elements (rows x width) below which the work runs on one thread (torch's grain size)
FIRST_PROBE, LAST_PROBE = 16, 512  # runs between tries of the count not chosen: first, and at most
SMOOTHING = 0.3  # weight of the newest run in a count's average time per element
_MAIN_THREAD = threading.main_thread()


class ThreadChoice:
    """One kind of table work's thread count (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.seconds_per_element: dict = {}  # thread count -> average
        self.runs = 0
        self.best = None  # the count chosen last, outside a probe
        self.probe_interval, self.next_probe = FIRST_PROBE, FIRST_PROBE

    def choose(self, elements: int, available: int) -> int:
        if available <= 1 or elements < SMALL_WORK:
            return 1
        counts = (1, available)
        untried = [count for count in counts if count not in self.seconds_per_element]
        if untried:
            return untried[0]
        best = min(counts, key=self.seconds_per_element.get)
        if best != self.best:  # a probe won, or the first choice: probe soon again
            self.best, self.probe_interval, self.next_probe = best, FIRST_PROBE, self.runs + FIRST_PROBE
        if self.runs >= self.next_probe:  # try the other count; if it loses again, wait twice as long
            self.probe_interval = min(2 * self.probe_interval, LAST_PROBE)
            self.next_probe = self.runs + self.probe_interval
            return counts[0] if best == counts[1] else counts[1]
        return best

    def record(self, threads: int, elements: int, seconds: float) -> None:
        per_element = seconds / max(elements, 1)
        old = self.seconds_per_element.get(threads)
        self.seconds_per_element[threads] = per_element if old is None else \
            (1 - SMOOTHING) * old + SMOOTHING * per_element
        self.runs += 1

    @contextlib.contextmanager
    def threads_for(self, elements: int, device: torch.device):
        """Run the block's CPU work on the chosen count of threads (``device`` a GPU: as it is)."""
        available = torch.get_num_threads()
        if torch.device(device).type != "cpu" or available <= 1 or threading.current_thread() is not _MAIN_THREAD:
            yield  # the host tier's worker thread keeps torch's count: its thread count is not its own to change
            return
        threads = self.choose(elements, available)
        if threads != available:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            if threads != available:
                torch.set_num_threads(available)
            if elements >= SMALL_WORK:
                self.record(threads, elements, seconds)


GATHER, GRADIENT, UPDATE = ThreadChoice("gather"), ThreadChoice("gradient"), ThreadChoice("update")
