"""The Megatron step's optimizer phase with the gradient norm computed once against twice.

fe-pretrain checks the loss and the gradient norm for non-finite values before it updates.  It used
to call ``prepare_grads()`` and ``get_grad_norm()`` for that check and then Megatron's
``optimizer.step()``, which prepares the gradients and computes the norm again: two passes over
every gradient, the tables' included.  It now clips by the norm it already has
(`fe_megatron.megatron.compat.step_with_grad_norm`).  Both variants run on one model in one
process, alternating step by step, after the same forward and backward.

    python benchmarks/bench_optimizer_step.py [--size small|tiny] [--steps 8]

Prints the median milliseconds of the optimizer phase (after the backward) and of the whole step,
and their ratios, as JSON.
"""

import argparse
import json
import math
import platform
import statistics
import time
import warnings

import torch

from bench_train import SIZES as TRAIN_SIZES  # this folder is on the path when the script runs

warnings.filterwarnings("ignore")

# bench_train.py's models; "small" (12 layers at d=512, two memory layers, 183M table parameters) at
# 256 tokens per sequence: the optimizer phase does not depend on it, the forward and backward do
SIZES = {name: {**size, "backbone": {**size["backbone"], "seq_length": 256}} if name == "small" else size
         for name, size in TRAIN_SIZES.items() if name in ("tiny", "small")}


def main():
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.megatron import compat
    from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.engine import transformer_config_for
    from fe_megatron.megatron.parallel import initialize, shutdown
    from fe_megatron.megatron.step import causal_mask, run_microbatches
    from fe_megatron.training.config import TrainConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each variant")
    args = parser.parse_args()
    s = SIZES[args.size]
    backbone = BackboneConfig.from_dict(s["backbone"])
    vocab, seq = backbone.vocab_size, backbone.seq_length
    initialize()
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(s["micro"]):
        tokens = torch.randint(0, vocab, (s["mbs"], seq + 1), generator=generator)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(s["mbs"], seq),
                            position_ids=torch.arange(seq).expand(s["mbs"], -1), attention_mask=causal_mask(seq)))
    tconfig = transformer_config_for(TrainConfig(model=backbone), on_gpu=False)
    model = build_gpt_model(tconfig, vocab, seq, MemoryConfig.from_dict(s["memory"], backbone=backbone))
    ddp = wrap_ddp(model, tconfig)
    optimizer = build_optimizer([ddp], OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0))
    connect_schedule_hooks(tconfig, [ddp], optimizer)

    def two_passes():  # the check, then Megatron's own step
        optimizer.prepare_grads()
        assert math.isfinite(float(optimizer.get_grad_norm()))
        optimizer.step()

    def one_pass():  # what train_step does now
        optimizer.prepare_grads()
        norm = float(optimizer.get_grad_norm())
        assert math.isfinite(norm)
        compat.step_with_grad_norm(optimizer, norm)

    variants = {"two passes (before)": two_passes, "one pass (now)": one_pass}
    times = {name: {"optimizer_ms": [], "step_ms": []} for name in variants}
    norm_ms = []  # one prepare_grads + get_grad_norm pass alone: what the second pass cost
    for step in range(2 + args.steps):  # 2 untimed steps per variant first
        for name, update in variants.items():
            start = time.perf_counter()
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            run_microbatches([ddp], batches, seq, s["mbs"], forward_only=False)
            backward_done = time.perf_counter()
            if name == "one pass (now)" and step >= 2:
                norm_start = time.perf_counter()
                optimizer.prepare_grads()
                optimizer.get_grad_norm()
                norm_ms.append(1e3 * (time.perf_counter() - norm_start))
                backward_done = time.perf_counter()
            update()
            end = time.perf_counter()
            if step >= 2:
                times[name]["optimizer_ms"].append(1e3 * (end - backward_done))
                times[name]["step_ms"].append(1e3 * (end - start) - (norm_ms[-1] if name == "one pass (now)" else 0))
    shutdown()
    medians = {name: {key: statistics.median(values) for key, values in t.items()} for name, t in times.items()}
    before, now = medians["two passes (before)"], medians["one pass (now)"]
    parameters = sum(p.numel() for p in model.parameters())
    print(json.dumps({
        "size": args.size, "parameters": parameters, "steps": args.steps, "torch": torch.__version__,
        "megatron_core": compat.megatron_core_version(), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "median_ms": medians, "one_norm_pass_ms": statistics.median(norm_ms),
        "optimizer_phase_ratio_now_over_before": round(now["optimizer_ms"] / before["optimizer_ms"], 3),
        "step_ratio_now_over_before": round(now["step_ms"] / before["step_ms"], 3)}, indent=1))


if __name__ == "__main__":
    main()
