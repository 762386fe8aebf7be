"""Training tokens/s of FactorEngram against the plain Transformer with the same backbone.

Both models are built and stepped in the same process, on the same random token batches,
with the same Megatron DDP + optimizer + schedule path as fe-pretrain.

    python benchmarks/bench_train.py [--size tiny|small|340m-layer] [--steps 10]

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
}


def main():
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.parallel import initialize, shutdown
    from fe_megatron.megatron.step import causal_mask, train_step
    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.megatron.engine import transformer_config_for
    from fe_megatron.training.config import TrainConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    s = SIZES[args.size]
    backbone = BackboneConfig.from_dict(s["backbone"])
    vocab, seq = backbone.vocab_size, backbone.seq_length
    initialize()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    cfg = TrainConfig(model=backbone)
    gen = torch.Generator().manual_seed(0)
    mask = causal_mask(seq, device)
    batches = []
    for _ in range(s["micro"]):
        tokens = torch.randint(0, vocab, (s["mbs"], seq + 1), generator=gen)
        batches.append({k: v.to(device) for k, v in dict(
            tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(s["mbs"], seq),
            position_ids=torch.arange(seq).expand(s["mbs"], -1)).items()} | {"attention_mask": mask})
    tokens_per_step = s["micro"] * s["mbs"] * seq
    results = {}
    for kind, mc in (("transformer", None), ("factorengram", MemoryConfig.from_dict(s["memory"], backbone=backbone))):
        tconfig = transformer_config_for(cfg, on_gpu)
        model = build_gpt_model(tconfig, vocab, seq, mc)
        if on_gpu:
            model.cuda()
        ddp = wrap_ddp(model, tconfig)
        opt = build_optimizer([ddp], OptimizerConfig(optimizer="adam", lr=1e-4, bf16=tconfig.bf16,
                                                     params_dtype=tconfig.params_dtype))
        connect_schedule_hooks(tconfig, [ddp], opt)
        for _ in range(2):
            train_step([ddp], opt, batches, seq, s["mbs"])
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            train_step([ddp], opt, batches, seq, s["mbs"])
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
