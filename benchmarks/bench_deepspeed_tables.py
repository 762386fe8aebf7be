"""DeepSpeed engine at DP=N: the tables as ZeRO-3 parameters (``zero``) against row-sharded
outside ZeRO (``rows``, fp32 tables, and ``rows-bf16``, bf16 tables with fp32 Adam moments), and
what ZeRO-3's whole-table all-gather costs at the 340M shapes.

    python benchmarks/bench_deepspeed_tables.py [--size small] [--steps 5] [--nproc 2] [--checkpoint-dir DIR]

It starts ``torchrun --nproc_per_node N`` once per mode (ZeRO-3 keeps global state, so each mode
gets fresh processes) and once for the collective timing, and prints markdown rows:

* training: tokens/s and per-rank resident and peak resident memory (max over ranks) for the same
  random batches,
  fe-pretrain's DeepSpeed step (`fe_megatron.deepspeed.engine.DeepSpeedRun.train_step`), fp32;
* all-gather: one ``factorengram-340m`` memory layer's tables (12 branches, 545M rows x s_b
  values in all, fp32), partitioned over N ranks as ZeRO-3 holds them, all-gathered as ZeRO-3
  does before the layer's forward (and again before its backward), and its gradient
  reduce-scattered;
* with ``--checkpoint-dir``: the seconds to save and to load the tables outside ZeRO (rows modes),
  the best of 3, and the megabytes one save writes.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = ["zero", "rows", "rows-bf16"]
TIMEOUT_MINUTES = 30  # a collective without its peers fails after this
SIZES = {  # as benchmarks/bench_table_sharding.py: the 340M model's 3:1 ratio of tables to backbone
    "small": dict(model=dict(vocab_size=32000, hidden_size=512, num_layers=6, num_attention_heads=8,
                             ffn_hidden_size=1408, seq_length=256),
                  memory=dict(preset="factorengram-340m", table_capacity=[32000, 100_000, 100_000], coeff_width=768,
                              memory_dim=768, layers=[2, 3]), micro_batch=2, microbatches=2),
    "tiny": dict(model=dict(preset="tiny"), memory=dict(preset="factorengram-tiny"), micro_batch=8, microbatches=2),
}


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2 ** 20


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 10  # KiB on Linux


def train_worker(size_name: str, mode: str, steps: int, checkpoint_dir: str = None) -> None:
    import deepspeed
    import torch.distributed as dist

    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.deepspeed.config import resolve
    from fe_megatron.deepspeed.clipping import JointClipping
    from fe_megatron.deepspeed.engine import DeepSpeedRun, _init_distributed, build_engine, shut_down
    from fe_megatron.checkpoint.resume_guard import schedule_in_force
    from fe_megatron.tables.plan import TablePlan
    from fe_megatron.training.config import OptimizerArgs, ParallelArgs, TrainConfig, TrainingArgs

    size = SIZES[size_name]
    tables, table_dtype = ("rows", "bf16") if mode == "rows-bf16" else (mode, "fp32")
    _init_distributed(TIMEOUT_MINUTES)
    world, rank = dist.get_world_size(), dist.get_rank()
    backbone = BackboneConfig.from_dict(size["model"])
    cfg = TrainConfig(model=backbone, memory=MemoryConfig.from_dict(dict(size["memory"], table_dtype=table_dtype),
                                                                    backbone=backbone),
                      parallel=ParallelArgs(table_sharding=tables),
                      optimizer=OptimizerArgs(lr=1e-4, warmup_steps=0),
                      training=TrainingArgs(engine="deepspeed", train_steps=1000, micro_batch_size=size["micro_batch"],
                                            global_batch_size=size["micro_batch"] * size["microbatches"] * world),
                      deepspeed={"zero_optimization": {"stage": 3}})
    plan = TablePlan.for_run(cfg)  # fe-pretrain's own set-up (fe_megatron.deepspeed.engine.set_up), without data
    engine, row_tables, _ = build_engine(deepspeed, cfg, resolve(cfg, world, False), plan)
    info = {"schedule": schedule_in_force(None, {"config": dataclasses.asdict(cfg)})}
    run = DeepSpeedRun(cfg=cfg, info=info, engine=engine, tables=row_tables, clipping=JointClipping(engine, row_tables),
                       datasets=(), metrics=None,
                       num_microbatches=size["microbatches"], start_step=0, parameters=0)
    gen = torch.Generator().manual_seed(100 + rank)
    seq, batches = backbone.seq_length, []
    for _ in range(size["microbatches"]):
        tokens = torch.randint(0, backbone.vocab_size, (size["micro_batch"], seq + 1), generator=gen)
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(tokens[:, 1:].shape),
                        "position_ids": torch.arange(seq).expand(size["micro_batch"], seq)})
    for _ in range(2):
        run.train_step(batches)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        run.train_step(batches)
    dist.barrier()
    seconds = time.perf_counter() - start
    memory = [None] * world
    dist.all_gather_object(memory, (rss_mb(), peak_rss_mb()))
    saved = save_and_load_tables(row_tables, checkpoint_dir) if checkpoint_dir and row_tables is not None else {}
    if rank == 0:
        tokens = steps * size["micro_batch"] * size["microbatches"] * world * seq
        print(json.dumps({"tables": mode, "tokens_per_s": tokens / seconds, "rss_mb": [m[0] for m in memory],
                          "peak_rss_mb": [m[1] for m in memory], **saved}))
    shut_down()  # fe-pretrain's shutdown: the engine, then the groups, joined before Python exits


def save_and_load_tables(tables, directory: str, repeats: int = 3) -> dict:
    """The best of ``repeats`` saves and loads of the tables outside ZeRO (`StoredTables.save` and
    ``load``, every rank at once) into folders under ``directory``, and the bytes one save writes."""
    import torch.distributed as dist

    best = {"table_save_s": float("inf"), "table_load_s": float("inf")}
    for repeat in range(repeats):
        folder = os.path.join(directory, f"save_{repeat}")
        if dist.get_rank() == 0:
            os.makedirs(folder)
        for key, action in (("table_save_s", tables.save), ("table_load_s", tables.load)):
            dist.barrier()
            start = time.perf_counter()
            action(folder)
            dist.barrier()
            best[key] = min(best[key], time.perf_counter() - start)
    first = os.path.join(directory, "save_0")
    best["table_checkpoint_mb"] = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(first)
                                      for name in names) / 2 ** 20
    return best


def gather_worker(repeats: int) -> None:
    """ZeRO-3's collectives for one 340M memory layer's tables, fp32, at the launcher's N ranks."""
    import torch.distributed as dist

    from fe_megatron.config import MemoryConfig
    from fe_megatron.deepspeed.engine import _init_distributed, shut_down

    _init_distributed(TIMEOUT_MINUTES)
    world, rank = dist.get_world_size(), dist.get_rank()
    from fe_megatron.ngram import NgramHasher

    memory = MemoryConfig.from_preset("factorengram-340m")
    numel = NgramHasher(memory, memory.layers[0]).layouts[0].total_rows * memory.branch_width
    part = torch.randn((numel + world - 1) // world)
    whole = torch.empty(part.numel() * world)
    timings = {"all_gather": [], "reduce_scatter": []}
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_into_tensor(whole, part)
        timings["all_gather"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        dist.reduce_scatter_tensor(part, whole)
        timings["reduce_scatter"].append(time.perf_counter() - start)
    if rank == 0:
        gathered = whole.numel() * 4 * (world - 1) / world  # bytes each rank receives
        best = {k: min(v) for k, v in timings.items()}
        print(json.dumps({"layer_table_params": numel, "layer_table_gb": numel * 4 / 1e9, "world": world,
                          "all_gather_s": best["all_gather"], "reduce_scatter_s": best["reduce_scatter"],
                          "all_gather_gb_per_s": gathered / best["all_gather"] / 1e9}))
    shut_down()


def launch(nproc: int, args: list) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(29600 + os.getpid() % 300), os.path.abspath(__file__)] + args,
                          capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"torchrun {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["zero", "rows", "rows-bf16"], choices=MODES)
    parser.add_argument("--no-gather", action="store_true", help="skip the all-gather timing")
    parser.add_argument("--checkpoint-dir", help="also time saving and loading the tables outside ZeRO "
                        "(StoredTables.save and load) in folders under this empty directory, on one file system")
    parser.add_argument("--worker", choices=MODES + ["gather"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "gather":
        return gather_worker(args.repeats)
    if args.worker:
        return train_worker(args.size, args.worker, args.steps, args.checkpoint_dir)
    results = {}
    for mode in args.modes:
        extra = ["--checkpoint-dir", os.path.join(args.checkpoint_dir, mode)] if args.checkpoint_dir else []
        results[mode] = launch(args.nproc, ["--worker", mode, "--size", args.size, "--steps", str(args.steps)] + extra)
    print("| size | tables | tok/s | rss MB per rank (max) | peak rss MB per rank (max) |\n|---|---|---:|---:|---:|")
    for mode, result in results.items():
        print(f"| {args.size} | {mode} | {result['tokens_per_s']:,.0f} | {max(result['rss_mb']):,.0f} "
              f"| {max(result['peak_rss_mb']):,.0f} |")
    if args.checkpoint_dir:
        print("| size | tables | save s (best of 3) | load s (best of 3) | MB written |\n|---|---|---:|---:|---:|")
        for mode, result in results.items():
            if "table_save_s" in result:
                print(f"| {args.size} | {mode} | {result['table_save_s']:.3f} | {result['table_load_s']:.3f} "
                      f"| {result['table_checkpoint_mb']:,.1f} |")
    if "rows" in results and "zero" in results:
        print(f"rows / zero tokens/s: {results['rows']['tokens_per_s'] / results['zero']['tokens_per_s']:.2f}x")
    if not args.no_gather:
        print(json.dumps(launch(args.nproc, ["--worker", "gather", "--repeats", str(args.repeats)])))


if __name__ == "__main__":
    main()
