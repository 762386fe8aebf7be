"""Training with each table storage: peak resident memory, the tables' bytes, and tokens/s.

    python benchmarks/bench_table_storage.py [--size small] [--steps 3]

One fresh process per storage (so each peak is its own), each training the same model on the
same random batches through fe-pretrain's Megatron path (`fe_megatron.megatron.table_optimizer`
for tables in stores), one process (DP=1, whole tables):

* ``plain``: the same backbone without memory, the baseline the tables' memory is measured from;
* ``fp32``: fp32 tables held as Megatron's parameters (16 bytes per table parameter);
* ``fp32-host``: fp32 tables in host memory, rows fetched one microbatch ahead;
* ``fp32-host-no-prefetch``: the same, each layer fetching its rows when it needs them (what the
  lookahead saves: on a GPU, the host gather and the copy no longer overlap the compute);
* ``bf16``: bf16 tables with fp32 moments (14 bytes);
* ``bf16-bf16``: bf16 tables, gradient and moments (8 bytes);
* ``bf16-bf16-host``: the same in host memory.

Each worker reports its peak resident set (``ru_maxrss``), on a GPU its peak device memory
(``torch.cuda.max_memory_allocated``), the bytes its tables, their gradients and moments occupy
(counted from the tensors), and tokens/s over the steps after the first.  On
a CPU machine host and device are the same memory, so the host tier's rows show its bookkeeping
cost (deduplicated gathers, the gradient worker), not an offload; a GPU measures the overlap
(`make gpu-check`, tests/gpu).
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = {
    # 4 x d512 backbone (about 29M parameters) and 237M table parameters (3.8 GB at 16 bytes each):
    # the tables dominate, as at the paper's scales
    "small": dict(backbone=dict(vocab_size=32000, hidden_size=512, num_layers=4, num_attention_heads=8,
                                ffn_hidden_size=1408, seq_length=256),
                  memory=dict(preset="factorengram-340m", table_capacity=[32000, 100_000, 100_000], coeff_width=1536,
                              memory_dim=512, layers=[1, 2]), micro_batch=2, microbatches=2),
    "tiny": dict(backbone=dict(preset="tiny"), memory=dict(preset="factorengram-tiny"), micro_batch=8,
                 microbatches=2),
}
STORAGES = {  # name: (memory.table_dtype, optimizer.table_state_dtype, memory.table_placement), or None: no memory
    "plain": None, "fp32": ("fp32", "fp32", "device"), "fp32-host": ("fp32", "fp32", "host"),
    "fp32-host-no-prefetch": ("fp32", "fp32", "host"), "bf16": ("bf16", "fp32", "device"),
    "bf16-bf16": ("bf16", "bf16", "device"), "bf16-bf16-host": ("bf16", "bf16", "host"),
}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 10  # KiB on Linux


def table_bytes(model, optimizer) -> int:
    """Bytes of every table, its gradient and its Adam moments, counted from the tensors."""
    from fe_megatron.memory.branch import memory_branches

    total = 0
    states = {}
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        states.update(member.optimizer.state)
    for branch in memory_branches(model).values():
        weight = branch.tables.weight
        grad = branch.tables.store.main_grad if branch.tables.store is not None else weight.main_grad
        moments = [tensor for key, tensor in states.get(weight, {}).items() if key in ("exp_avg", "exp_avg_sq")]
        total += sum(t.numel() * t.element_size() for t in [weight, grad] + moments)
    return total


def worker(size_name: str, storage: str, steps: int) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.engine import transformer_config_for
    from fe_megatron.megatron.parallel import initialize
    from fe_megatron.megatron.step import causal_mask, train_step
    from fe_megatron.megatron.table_optimizer import manage_tables
    from fe_megatron.tables.plan import TablePlan
    from fe_megatron.tables.lookahead import HOST_TOKENS
    from fe_megatron.training.config import OptimizerArgs, TrainConfig
    from fe_megatron.training.distributed import current_device

    size = SIZES[size_name]
    backbone = BackboneConfig.from_dict(size["backbone"])
    initialize(seed=1)
    choice = STORAGES[storage]
    memory = None
    optimizer_args = OptimizerArgs(lr=1e-4)
    if choice is not None:
        table_dtype, state_dtype, placement = choice
        memory = MemoryConfig.from_dict(dict(size["memory"], table_dtype=table_dtype, table_placement=placement),
                                        backbone=backbone)
        optimizer_args.table_state_dtype = state_dtype
    cfg = TrainConfig(model=backbone, memory=memory, optimizer=optimizer_args)
    on_gpu = torch.cuda.is_available()
    tconfig = transformer_config_for(cfg, on_gpu=on_gpu)
    model = build_gpt_model(tconfig, backbone.vocab_size, backbone.seq_length, memory)
    plan = TablePlan.for_run(cfg, tconfig.bf16) if memory is not None else None
    tables = manage_tables(model, optimizer_args, plan, current_device(), seed=1) \
        if plan is not None and plan.in_stores else None
    if tconfig.bf16:
        model.to(torch.bfloat16)
    if on_gpu:
        model.cuda()
    ddp = wrap_ddp(model, tconfig)
    opt = build_optimizer([ddp], OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0, bf16=tconfig.bf16,
                                                 params_dtype=tconfig.params_dtype), tables=tables)
    connect_schedule_hooks(tconfig, [ddp], opt)
    seq, mbs = backbone.seq_length, size["micro_batch"]
    gen = torch.Generator().manual_seed(100)
    device = current_device()
    batches = []
    for _ in range(size["microbatches"]):
        tokens = torch.randint(0, backbone.vocab_size, (mbs, seq + 1), generator=gen)
        batch = dict(tokens=tokens[:, :-1].to(device), labels=tokens[:, 1:].to(device),
                     loss_mask=torch.ones(mbs, seq, device=device),
                     position_ids=torch.arange(seq, device=device).expand(mbs, seq),
                     attention_mask=causal_mask(seq, device))
        if memory is not None and memory.table_placement == "host" and not storage.endswith("no-prefetch"):
            batch[HOST_TOKENS] = tokens[:, :-1]  # the one-microbatch lookahead, as fe-pretrain feeds it
        batches.append(batch)
    train_step([ddp], opt, batches, seq, mbs)  # the first step allocates the optimizer state
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        train_step([ddp], opt, batches, seq, mbs)
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"storage": storage, "peak_rss_mb": peak_rss_mb(), "table_bytes": table_bytes(model, opt) if memory else 0,
            "peak_device_mb": torch.cuda.max_memory_allocated() / 2 ** 20 if on_gpu else None,
            "tokens_per_s": steps * len(batches) * mbs * seq / seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--storages", nargs="+", default=list(STORAGES), choices=list(STORAGES))
    parser.add_argument("--worker", choices=list(STORAGES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.size, args.worker, args.steps)), flush=True)
        return
    results = {}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for storage in args.storages:
        proc = subprocess.run([sys.executable, __file__, "--worker", storage, "--size", args.size,
                               "--steps", str(args.steps)], capture_output=True, text=True, env=env, cwd=ROOT)
        line = [entry for entry in proc.stdout.splitlines() if entry.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            raise SystemExit(f"{storage} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        results[storage] = json.loads(line[0][len("RESULT "):])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    print(f"# {args.size}, {args.steps} steps, {device}, torch {torch.__version__}")
    print("| storage | tables + grads + moments (MB) | peak RSS (MB) | peak RSS above plain (MB) | peak device (MB) "
          "| tok/s |\n|---|---:|---:|---:|---:|---:|")
    base = results.get("plain", {}).get("peak_rss_mb", 0.0)
    for storage, result in results.items():
        device_mb = result["peak_device_mb"]
        print(f"| {storage} | {result['table_bytes'] / 2 ** 20:,.0f} | {result['peak_rss_mb']:,.0f} | "
              f"{result['peak_rss_mb'] - base:,.0f} | {'-' if device_mb is None else f'{device_mb:,.0f}'} | "
              f"{result['tokens_per_s']:,.0f} |")
    print(json.dumps({"results": results}))
    if "fp32" in results and "plain" in results:
        reference = results["fp32"]
        for storage in ("bf16", "bf16-bf16", "bf16-bf16-host", "fp32-host", "fp32-host-no-prefetch"):
            if storage in results:
                r = results[storage]
                print(f"{storage} / fp32: table bytes {r['table_bytes'] / reference['table_bytes']:.2f}x, peak RSS "
                      f"above plain {(r['peak_rss_mb'] - base) / (reference['peak_rss_mb'] - base):.2f}x, tokens/s "
                      f"{r['tokens_per_s'] / reference['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
