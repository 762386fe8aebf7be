"""Training tokens/s of FactorEngram against the plain Transformer with the same backbone.

The models are built and stepped in the same process, on the same random token batches,
with the same Megatron DDP + optimizer + schedule path as fe-pretrain: the Transformer, then
FactorEngram with each table update of ``--table-updates`` (``optimizer.table_update``:
``adamw``, the default, updates every row, as fe-pretrain without the distributed optimizer does, by the
table optimizer's one-pass AdamW over stores, or with ``--engine-adam`` as Megatron's parameters, by its
Adam; ``rowwise_adagrad`` and ``lazy_adam`` update only the touched rows, from table stores; ``UPDATE:host``
keeps the tables in the host tier's stores). ``--busy-cores N`` keeps N cores busy while each is measured.

    python benchmarks/bench_train.py [--size tiny|small|340m-layer|340m] [--steps 10] \
        [--table-updates adamw,rowwise_adagrad,lazy_adam,adamw:host] [--engine-adam] [--busy-cores 1] \
        [--precision auto|bf16|fp32]

``--precision auto`` (the default) runs in bf16 on a GPU machine and in fp32 on CPU, as fe-pretrain
does; ``bf16`` on CPU runs the GPU's casts at CPU speed (`make gpu-check-dry`).  ``340m`` is the
whole ``factorengram-340m`` preset (Table 8: 24 layers at width 1024, memory at layers 10 and 12,
1.1B table parameters) against the same backbone, at sequence length 4096.  ``matmul_bound_ratio`` is the ratio of the two
models' matrix-product work per token (`matmul_macs_per_token`): the tokens/s ratio a step bound by
its matrix products would reach, whatever the tables cost.
"""

import argparse
import dataclasses
import gc
import json
import platform
import time
import warnings

import torch

from host_load import busy_cores  # this folder is on the path when the script runs

warnings.filterwarnings("ignore")

SIZES = {
    "tiny": dict(backbone=dict(preset="tiny"), memory=dict(preset="factorengram-tiny"), mbs=8, micro=2),
    "small": dict(backbone=dict(vocab_size=32000, hidden_size=512, num_layers=12, num_attention_heads=8,
                                ffn_hidden_size=1408, seq_length=512),
                  memory=dict(preset="factorengram-340m", table_capacity=[32000, 100_000, 100_000], coeff_width=1536,
                              memory_dim=1536, layers=[5, 6]), mbs=4, micro=2),
    # one layer at the 340M width with the paper's memory (Table 8) against the plain layer: the
    # memory's cost where it sits, diluted only by the embedding and the output layer
    "340m-layer": dict(backbone=dict(vocab_size=32000, hidden_size=1024, num_layers=1, num_attention_heads=16,
                                     ffn_hidden_size=2816, seq_length=4096),
                       memory=dict(preset="factorengram-340m", layers=[0]), mbs=4, micro=2),
    # the whole 340M preset (Table 8) against its backbone; sequences of 4096 (the preset's 8192
    # halved: the local spec keeps the full score matrix of every layer for the backward)
    # (mbs 2 ran out of an H200's 140 GiB: 24 layers' saved score matrices beside 1.1B table parameters)
    "340m": dict(backbone=dict(preset="340m", seq_length=4096), memory=dict(preset="factorengram-340m"),
                 mbs=1, micro=4),
}


def matmul_macs_per_token(backbone, memory=None) -> int:
    """Multiply-accumulates per token of the model's matrix products in one forward pass (the
    backward's are twice these for both models, so ratios hold for the step): attention (with the
    full score matrix, as the local spec computes it), the gated MLP and the output layer, plus, with
    ``memory`` (FactorEngram), per memory layer the query ``Q^T h`` (Eq. 7; not with gate 'none'),
    ``D q`` (Eq. 7, basis gate), ``D^T (z * alpha)`` (Eq. 8) and ``V e`` (Eq. 9)."""
    d, seq, ffn = backbone.hidden_size, backbone.seq_length, backbone.ffn_hidden_size
    kv = d * (backbone.num_query_groups or backbone.num_attention_heads) // backbone.num_attention_heads
    per_layer = d * d + 2 * d * kv + 2 * seq * d + d * d + 3 * d * ffn
    macs = backbone.num_layers * per_layer + d * backbone.vocab_size
    if memory is not None:
        if memory.kind != "factorengram":
            raise ValueError(f"matmul_macs_per_token counts FactorEngram's branch, not kind={memory.kind!r}")
        s, d_m = memory.coeff_width, memory.memory_dim
        query = d * d_m if memory.gate != "none" else 0
        gate = s * d_m if memory.gate == "basis" else 0
        branch = query + gate + s * d_m + d_m * memory.output_size
        macs += len(memory.layers) * branch
    return macs


def random_batches(vocab: int, seq: int, mbs: int, micro: int, device) -> list:
    """``micro`` microbatches of ``mbs`` random sequences (seed 0) in fe-pretrain's batch layout, on ``device``."""
    from fe_megatron.megatron.step import causal_mask

    gen = torch.Generator().manual_seed(0)
    mask = causal_mask(seq, device)
    batches = []
    for _ in range(micro):
        tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)
        batches.append({k: v.to(device) for k, v in dict(
            tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(mbs, seq),
            position_ids=torch.arange(seq).expand(mbs, -1)).items()} | {"attention_mask": mask})
    return batches


def main():
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.parallel import initialize, shutdown
    from fe_megatron.megatron.step import train_step
    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.megatron.engine import transformer_config_for
    from fe_megatron.megatron.table_optimizer import manage_tables
    from fe_megatron.tables.plan import TablePlan
    from fe_megatron.training.config import OptimizerArgs, TrainConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--table-updates", default="adamw,rowwise_adagrad,lazy_adam",
                        help="the FactorEngram variants to run, by optimizer.table_update; UPDATE:host keeps the "
                             "tables in the host tier's stores (memory.table_placement=host)")
    parser.add_argument("--engine-adam", action="store_true",
                        help="dense tables as Megatron's parameters, trained by its Adam (fe-pretrain with "
                             "parallel.distributed_optimizer); default: fe-pretrain's own rule, the table "
                             "optimizer's one-pass AdamW over stores")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="training.precision: auto is bf16 on a GPU and fp32 on CPU")
    parser.add_argument("--busy-cores", type=int, default=0,
                        help="processes that each keep one core busy while every variant is measured")
    parser.add_argument("--allocator", choices=("keep", "system"), default="keep",
                        help="keep: malloc keeps freed host memory, as fe-pretrain sets it on a CPU run "
                             "(fe_megatron.tables.host_allocator); system: glibc's defaults")
    args = parser.parse_args()
    allocator = "host allocator: the system's"
    if args.allocator == "keep" and not torch.cuda.is_available():
        from fe_megatron.tables.host_allocator import keep_freed_host_memory

        allocator = keep_freed_host_memory()
    s = SIZES[args.size]
    backbone = BackboneConfig.from_dict(s["backbone"])
    vocab, seq = backbone.vocab_size, backbone.seq_length
    initialize()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    cfg = TrainConfig(model=backbone)
    cfg.training.precision = args.precision
    batches = random_batches(vocab, seq, s["mbs"], s["micro"], device)
    tokens_per_step = s["micro"] * s["mbs"] * seq
    results, peak_gib = {}, {}
    memory = MemoryConfig.from_dict(s["memory"], backbone=backbone)
    variants = [("transformer", None, None)]
    for variant in args.table_updates.split(","):
        update, _, placement = variant.partition(":")  # adamw:host: the table update, in the host tier's stores
        name = "factorengram" if update == "adamw" else f"factorengram_{update}"
        variants.append((f"{name}_{placement}" if placement else name,
                         dataclasses.replace(memory, table_placement=placement) if placement else memory, update))
    for kind, mc, update in variants:
        tconfig = transformer_config_for(cfg, on_gpu)
        model = build_gpt_model(tconfig, vocab, seq, mc)
        tables = None
        plan = TablePlan.resolve("megatron", mc.table_dtype, placement=mc.table_placement, update=update,
                                 bf16_run=tconfig.bf16, one_pass_adamw=not args.engine_adam) \
            if mc is not None else None
        if plan is not None and plan.in_stores:
            tables = manage_tables(model, OptimizerArgs(lr=1e-4), plan, device, seed=1)
        if tconfig.bf16:  # every parameter in bf16, as the engine's build_stage_model makes them
            model.to(torch.bfloat16)
        if on_gpu:
            model.cuda()
        ddp = wrap_ddp(model, tconfig)
        opt = build_optimizer([ddp], OptimizerConfig(optimizer="adam", lr=1e-4, bf16=tconfig.bf16,
                                                     params_dtype=tconfig.params_dtype), tables=tables)
        connect_schedule_hooks(tconfig, [ddp], opt)
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            train_step([ddp], opt, batches, seq, s["mbs"])
        if on_gpu:
            torch.cuda.synchronize()
        with busy_cores(args.busy_cores):
            start = time.perf_counter()
            for _ in range(args.steps):
                train_step([ddp], opt, batches, seq, s["mbs"])
            if on_gpu:
                torch.cuda.synchronize()
            results[kind] = tokens_per_step * args.steps / (time.perf_counter() - start)
        if on_gpu:
            peak_gib[kind] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        del ddp, opt, model, tables
        gc.collect()  # the next variant starts on an empty device: nothing of this one is left cached
        if on_gpu:
            torch.cuda.empty_cache()
    device_name = (torch.cuda.get_device_name() if on_gpu
                   else f"{platform.machine()} CPU, {torch.get_num_threads()} threads")
    # the ratio a step bound by its matrix products would reach: what no table work can beat
    bound = matmul_macs_per_token(backbone) / matmul_macs_per_token(backbone, memory)
    print(json.dumps({"size": args.size, "device": device_name, "bf16": tconfig.bf16, "date": time.strftime("%Y-%m-%d"),
                      "allocator": allocator, "busy_cores": args.busy_cores, "table_trainer": "engine's Adam" if
                      args.engine_adam else "fe-pretrain's rule (one-pass AdamW over stores without the distributed "
                      "optimizer)",
                      **{f"{kind}_tokens_per_s": round(value) for kind, value in results.items()},
                      **{f"{kind}_ratio": round(value / results["transformer"], 3) for kind, value in results.items()
                         if kind != "transformer"},
                      "matmul_bound_ratio": round(bound, 3),
                      **({"peak_gib": peak_gib} if peak_gib else {})}))
    shutdown()


if __name__ == "__main__":
    main()
