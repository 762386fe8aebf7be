"""Training tokens/s of FactorEngram against the plain Transformer with the same backbone.

Both models are built and stepped in the same process, on the same random token batches,
with the same Megatron DDP + optimizer + schedule path as fe-pretrain.

    python benchmarks/bench_train.py [--size tiny|small] [--steps 10]

On a GPU machine it runs in bf16; on CPU in fp32.
"""

import argparse
import json
import platform
import time
import warnings

import torch

warnings.filterwarnings("ignore")

SIZES = {
    "tiny": dict(layers=4, hidden=128, heads=4, ffn=384, seq=128, mbs=8, micro=2, vocab=4096, preset="factorengram-tiny"),
    "small": dict(layers=12, hidden=512, heads=8, ffn=1408, seq=512, mbs=4, micro=2, vocab=32000, preset=None),
}


def memory_config(size):
    from fe_megatron.config import MemoryConfig

    s = SIZES[size]
    if s["preset"]:
        return MemoryConfig.from_preset(s["preset"])
    return MemoryConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_layers=s["layers"], ffn_hidden_size=s["ffn"],
                        table_capacity=[32000, 100_000, 100_000], coeff_width=1536, memory_dim=1536, layers=[5, 6])


def main():
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.parallel import initialize, shutdown
    from fe_megatron.megatron.step import causal_mask, train_step
    from fe_megatron.train import transformer_config_for
    from fe_megatron.train_config import ModelArgs, TrainConfig, TrainingArgs

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    s = SIZES[args.size]
    initialize()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    cfg = TrainConfig(model=ModelArgs(num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                                      ffn_hidden_size=s["ffn"], vocab_size=s["vocab"], seq_length=s["seq"]),
                      training=TrainingArgs())
    gen = torch.Generator().manual_seed(0)
    mask = causal_mask(s["seq"], device)
    batches = []
    for _ in range(s["micro"]):
        tokens = torch.randint(0, s["vocab"], (s["mbs"], s["seq"] + 1), generator=gen)
        batches.append({k: v.to(device) for k, v in dict(
            tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(s["mbs"], s["seq"]),
            position_ids=torch.arange(s["seq"]).expand(s["mbs"], -1)).items()} | {"attention_mask": mask})
    tokens_per_step = s["micro"] * s["mbs"] * s["seq"]
    results = {}
    for kind, mc in (("transformer", None), ("factorengram", memory_config(args.size))):
        tconfig = transformer_config_for(cfg, on_gpu)
        model = build_gpt_model(tconfig, s["vocab"], s["seq"], mc)
        if on_gpu:
            model.cuda()
        ddp = wrap_ddp(model, tconfig)
        opt = build_optimizer([ddp], OptimizerConfig(optimizer="adam", lr=1e-4, bf16=tconfig.bf16,
                                                     params_dtype=tconfig.params_dtype))
        connect_schedule_hooks(tconfig, [ddp], opt)
        for _ in range(2):
            train_step([ddp], opt, batches, s["seq"], s["mbs"])
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            train_step([ddp], opt, batches, s["seq"], s["mbs"])
        if on_gpu:
            torch.cuda.synchronize()
        results[kind] = tokens_per_step * args.steps / (time.perf_counter() - start)
        del ddp, opt, model
    device_name = torch.cuda.get_device_name() if on_gpu else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    print(json.dumps({"size": args.size, "device": device_name, "date": time.strftime("%Y-%m-%d"),
                      "transformer_tokens_per_s": round(results["transformer"]),
                      "factorengram_tokens_per_s": round(results["factorengram"]),
                      "ratio": round(results["factorengram"] / results["transformer"], 3)}))
    shutdown()


if __name__ == "__main__":
    main()
