"""Run fe-pretrain's ``main`` with this script's arguments, then fail (exit 3) if a process
group's native threads are still running in this process.

Such threads would end only while Python exits, where they have aborted finished runs
("terminate called without an active exception", SIGABRT: a failure to the launcher).
Linux: the threads are read from /proc/self/task."""

import os
import sys

from fe_megatron.train import main

PROCESS_GROUP_THREADS = ("pt_gloo", "gloo_", "pt_nccl")  # the names torch and gloo give their threads


def process_group_threads() -> list:
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as fh:
            names.append(fh.read().strip())
    return sorted(name for name in names if name.startswith(PROCESS_GROUP_THREADS))


if __name__ == "__main__":
    code = main(sys.argv[1:])
    left = process_group_threads()
    if left:
        print(f"rank {os.environ.get('RANK')}: fe-pretrain returned with process-group threads still running: "
              f"{left}", flush=True)
        sys.exit(3)
    sys.exit(code)
