"""The memory in megatron-core's HybridModel against the memory in the GPT model: the same losses from the
same weights, and the tokens/s of each, in one run.

A pattern of ``*-`` pairs (attention, then MLP) is the GPT layer structure, so with the weights copied
across (`hybrid_pattern.gpt_name_of`) the two models compute the same function. Both go through
fe-pretrain's Megatron path (DDP, Megatron's optimizer, the pipeline schedule) on the same batches,
one step of each in turn.

    python benchmarks/bench_hybrid.py [--size tiny|small] [--steps 10] [--precision auto|bf16|fp32]

Needs megatron-core 0.19 or newer (HybridModel). ``--precision auto`` is bf16 on a GPU and fp32 on CPU.
Prints one JSON line: the largest LM-loss difference over the steps, and each model's tokens/s.
"""

import argparse
import dataclasses
import json
import platform
import time
import warnings

import torch

from bench_train import SIZES as TRAIN_SIZES
from bench_train import random_batches

warnings.filterwarnings("ignore")

# bench_train's sizes (the tiny one at half its micro-batch size, as this benchmark has always run it)
SIZES = {"tiny": dict(TRAIN_SIZES["tiny"], mbs=4), "small": TRAIN_SIZES["small"]}


def main():
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.megatron import compat
    from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.engine import transformer_config_for
    from fe_megatron.megatron.parallel import initialize, shutdown
    from fe_megatron.megatron.step import train_step
    from fe_megatron.training.config import TrainConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    args = parser.parse_args()
    if not compat.has_hybrid_model():
        raise SystemExit(f"bench_hybrid.py: megatron-core {compat.megatron_core_version()} has no HybridModel; "
                         f"install megatron-core>={compat.HYBRID_MINIMUM} (make setup-newest)")
    from fe_megatron.megatron.hybrid_model import FactorEngramHybridModel
    from fe_megatron.hybrid_pattern import gpt_name_of
    from fe_megatron.megatron.hybrid_specs import local_hybrid_stack_spec

    s = SIZES[args.size]
    backbone = BackboneConfig.from_dict(s["backbone"])
    memory = MemoryConfig.from_dict(s["memory"], backbone=backbone)
    vocab, seq = backbone.vocab_size, backbone.seq_length
    pattern = "*-" * backbone.num_layers
    initialize()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    cfg = TrainConfig(model=backbone)
    cfg.training.precision = args.precision
    tconfig = transformer_config_for(cfg, on_gpu)

    torch.manual_seed(0)
    gpt = build_gpt_model(tconfig, vocab, seq, memory)
    hybrid = FactorEngramHybridModel(dataclasses.replace(tconfig, num_layers=len(pattern)), local_hybrid_stack_spec(),
                                     vocab, seq, pattern, memory, position_embedding_type="rope",
                                     share_embeddings_and_output_weights=True)
    gpt_params = dict(gpt.named_parameters())
    with torch.no_grad():
        for name, param in hybrid.named_parameters():
            param.copy_(gpt_params[gpt_name_of(name, pattern)])
    chunks, optimizers = {}, {}
    for kind, model in (("gpt", gpt), ("hybrid", hybrid)):
        if tconfig.bf16:
            model.to(torch.bfloat16)
        model.to(device)
        chunks[kind] = [wrap_ddp(model, tconfig)]
        optimizers[kind] = build_optimizer(chunks[kind], OptimizerConfig(
            optimizer="adam", lr=1e-4, bf16=tconfig.bf16, params_dtype=tconfig.params_dtype))
        connect_schedule_hooks(tconfig, chunks[kind], optimizers[kind])

    batches = random_batches(vocab, seq, s["mbs"], s["micro"], device)
    losses = {"gpt": [], "hybrid": []}
    seconds = {"gpt": 0.0, "hybrid": 0.0}
    for step in range(args.steps + 1):
        for kind in ("gpt", "hybrid"):
            if on_gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = train_step(chunks[kind], optimizers[kind], batches, seq, s["mbs"])
            if on_gpu:
                torch.cuda.synchronize()
            if step:  # the first step of each warms up
                seconds[kind] += time.perf_counter() - start
            losses[kind].append(result.lm_loss)
    tokens = s["micro"] * s["mbs"] * seq * args.steps
    differences = [abs(a - b) for a, b in zip(losses["gpt"], losses["hybrid"])]
    device_name = (torch.cuda.get_device_name() if on_gpu
                   else f"{platform.machine()} CPU, {torch.get_num_threads()} threads")
    print(json.dumps({"size": args.size, "device": device_name, "bf16": tconfig.bf16, "steps": args.steps + 1,
                      "date": time.strftime("%Y-%m-%d"), "pattern": pattern,
                      "max_lm_loss_difference": max(differences),
                      "gpt_lm_loss": [round(v, 6) for v in losses["gpt"]],
                      "hybrid_lm_loss": [round(v, 6) for v in losses["hybrid"]],
                      "gpt_tokens_per_s": round(tokens / seconds["gpt"]),
                      "hybrid_tokens_per_s": round(tokens / seconds["hybrid"]),
                      "hybrid_over_gpt": round(seconds["gpt"] / seconds["hybrid"], 3)}))
    shutdown()


if __name__ == "__main__":
    main()
