"""Run fe-pretrain's ``main`` with this script's arguments (or, after ``--entry MODULE``, that
module's ``main``: ``fe_megatron.megatron_lm.pretrain_gpt``), then fail (exit 3) if a process
group's native threads are still running in this process.

Such threads would end only while Python exits, where they have aborted finished runs
("terminate called without an active exception", SIGABRT: a failure to the launcher).  The
TCP store's server thread counts too: rank 0 hosts the group's store in its own process when no
torchrun agent shares its own (one process, the deepspeed launcher, srun, torchrun.sh's
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and the group keeps it.
Linux: the threads are read from /proc/self/task."""

import importlib
import os
import sys

# the names torch and gloo give their threads: gloo's transport loop and work threads, NCCL's
# watchdogs, and the TCP store's server (pt_tcpstore_uv)
PROCESS_GROUP_THREADS = ("pt_gloo", "gloo_", "pt_nccl", "pt_tcpstore")


def process_group_threads() -> list:
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as fh:
            names.append(fh.read().strip())
    return sorted(name for name in names if name.startswith(PROCESS_GROUP_THREADS))


if __name__ == "__main__":
    arguments, entry = sys.argv[1:], "fe_megatron.train"
    if arguments[:1] == ["--entry"]:
        entry, arguments = arguments[1], arguments[2:]
    sys.argv = [entry, *arguments]  # as `python -m entry` would see them (Megatron-LM parses sys.argv)
    code = importlib.import_module(entry).main(arguments)
    left = process_group_threads()
    if left:
        counts = ", ".join(f"{name} x{left.count(name)}" for name in sorted(set(left)))
        print(f"rank {os.environ.get('RANK')}: {entry} returned with process-group threads still running: "
              f"{counts}", flush=True)
        sys.exit(3)
    sys.exit(code)
