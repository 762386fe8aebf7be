"""Host tables at DP=N on one host: whole, row-sharded and node-shared, by step time, bytes moved between
ranks and resident memory per rank and per node.

    python benchmarks/bench_node_tables.py [--size small] [--steps 5] [--ranks 2] [--busy-cores 0]

Runs one ``torchrun`` per layout, in turn, with the same batches and the same Megatron DDP + Adam path
as fe-pretrain, every table in host memory (``memory.table_placement: host``):

* ``whole`` (``table_sharding: replicated``): every rank holds every table, its gradient and its Adam
  moments; the tables' gradients are all-reduced;
* ``rows``: each rank holds its rows; every lookup and every row gradient goes through the all-to-all
  row exchange, also between two ranks of the node;
* ``node``: the rows split as with ``rows``, kept once for the node in shared memory
  (`fe_megatron.tables.node_shared`): a rank reads its node's rows straight from it, and only gradients
  travel to the rows' owners.

Per layout: tokens/s and step time; the bytes each rank sends to the other ranks per step through
all-to-alls (rows, requests and row gradients) and all-reduces (the backbone's gradients, and whole
tables' ones; a ring all-reduce sends 2 (N-1)/N of the tensor); each rank's resident memory, private
(``RssAnon``) and shared (``RssShmem``), and the node's: the ranks' private memory plus the shared
segments once.  Goal: node-shared holds one copy of the tables per node and moves no rows inside it.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYOUTS = {"whole": "replicated", "rows": "rows", "node": "node"}


def rank_memory_kib() -> dict:
    """This process's resident memory from /proc/self/status: private (RssAnon) and shared (RssShmem), KiB."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssShmem"):
                fields[name] = int(value.split()[0])
    return fields


class TrafficCounter:
    """The bytes this rank sends to the other ranks through ``all_to_all_single`` and ``all_reduce``."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.all_to_all, self.all_reduce = dist, dist.all_to_all_single, dist.all_reduce
        self.bytes = {"all_to_all": 0, "all_reduce": 0}

    def __enter__(self):
        dist = self.dist

        def all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
            world, me = dist.get_world_size(group), dist.get_rank(group)
            row_bytes = input[0].numel() * input.element_size() if input.dim() and input.shape[0] else 0
            splits = input_split_sizes or [input.shape[0] // world] * world
            self.bytes["all_to_all"] += (sum(splits) - splits[me]) * row_bytes
            return self.all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

        def all_reduce(tensor, *args, group=None, **kwargs):
            world = dist.get_world_size(group)
            self.bytes["all_reduce"] += int(tensor.numel() * tensor.element_size() * 2 * (world - 1) / world)
            return self.all_reduce(tensor, *args, group=group, **kwargs)

        dist.all_to_all_single, dist.all_reduce = all_to_all, all_reduce
        return self

    def __exit__(self, *exc):
        self.dist.all_to_all_single, self.dist.all_reduce = self.all_to_all, self.all_reduce


def run_layout(size: dict, sharding: str, steps: int, folder: str) -> dict:
    """One layout's training steps in this process group (under torchrun)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from bench_table_sharding import build_training, size_of
    from fe_megatron.megatron.step import train_step

    _, ddp, opt, stores, plan, batches = build_training(size, sharding, table_placement="host",
                                                        shared_table_folder=folder)
    seq, mbs = size_of(size)
    for _ in range(2):
        train_step([ddp], opt, batches, seq, mbs)
    dist.barrier()
    with TrafficCounter() as traffic:
        start = time.perf_counter()
        for _ in range(steps):
            train_step([ddp], opt, batches, seq, mbs)
        dist.barrier()
        elapsed = time.perf_counter() - start
    segments = 0
    if plan.node_shared:
        segments = sum(store.node.segment.weight.numel() * store.node.segment.weight.element_size()
                       for store in stores.stores.values())
    tokens_per_step = size["microbatches"] * mbs * seq * dist.get_world_size()
    result = {"tokens_per_s": tokens_per_step * steps / elapsed, "step_s": elapsed / steps,
              "all_to_all_MB_per_step": traffic.bytes["all_to_all"] / steps / 2 ** 20,
              "all_reduce_MB_per_step": traffic.bytes["all_reduce"] / steps / 2 ** 20,
              "segment_MB": segments / 2 ** 20, **rank_memory_kib()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    parallel_state.destroy_model_parallel()
    return everyone


def worker(args) -> None:
    import torch.distributed as dist

    from bench_table_sharding import SIZES

    results = run_layout(SIZES[args.size], LAYOUTS[args.layout], args.steps, args.folder)
    if dist.get_rank() == 0:
        with open(args.out, "w") as out:
            json.dump(results, out)
    dist.destroy_process_group()


def summarize(layout: str, ranks: list) -> dict:
    first = ranks[0]
    private = sum(r["RssAnon"] for r in ranks) / 1024
    shared_once = first["segment_MB"]
    return {"layout": layout, "tokens_per_s": round(sum(r["tokens_per_s"] for r in ranks) / len(ranks)),
            "step_s": round(max(r["step_s"] for r in ranks), 3),
            "all_to_all_MB_per_step_and_rank": round(sum(r["all_to_all_MB_per_step"] for r in ranks) / len(ranks), 2),
            "all_reduce_MB_per_step_and_rank": round(sum(r["all_reduce_MB_per_step"] for r in ranks) / len(ranks), 1),
            "rank_private_MB": [round(r["RssAnon"] / 1024) for r in ranks],
            "rank_shared_MB": [round(r["RssShmem"] / 1024) for r in ranks],
            "node_MB": round(private + shared_once)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", choices=("small", "tiny"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--busy-cores", type=int, default=0, help="keep this many cores busy meanwhile")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from host_load import busy_cores

    rows = []
    with busy_cores(args.busy_cores), tempfile.TemporaryDirectory() as scratch:
        for layout in args.layouts:
            out = os.path.join(scratch, f"{layout}.json")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
                       os.path.abspath(__file__), "--worker", "--layout", layout, "--size", args.size, "--steps",
                       str(args.steps), "--out", out, "--folder", "/dev/shm"]
            subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                           stdout=subprocess.DEVNULL)
            with open(out) as results:
                rows.append(summarize(layout, json.load(results)))
    base = rows[0]["tokens_per_s"]
    print(json.dumps({"size": args.size, "ranks": args.ranks, "busy_cores": args.busy_cores,
                      "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                      "layouts": [dict(row, over_whole=round(row["tokens_per_s"] / base, 3)) for row in rows]},
                     indent=1))


if __name__ == "__main__":
    main()
