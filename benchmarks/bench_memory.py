"""Forward+backward tokens/s of the FactorEngram module against a naive implementation.

The baseline keeps one ``nn.Embedding`` per branch and concatenates the lookups with
``torch.cat`` (how a first implementation usually looks); everything after ``z`` is the
same code.  Both are measured in the same run, on the same inputs, after checking that
they produce identical outputs.  ``--serving bf16 fp8`` also times the forward alone (no gradient,
as a served model runs) of the same module with its tables stored in those formats
(`fe_megatron.tables.storage`, read-only), against the baseline's forward.

    python benchmarks/bench_memory.py [--sizes small medium] [--steps 10] [--serving bf16 fp8]
"""

import argparse
import json
import platform
import time

import torch
import torch.nn as nn

from fe_megatron.config import MemoryConfig
from fe_megatron.memory import FactorEngram

SIZES = {
    # a laptop-scale branch and a medium one (340M-like widths, smaller tables and batch)
    "small": dict(config=dict(backbone="tiny", table_capacity=[4096, 16384, 16384], heads_per_order=2,
                              coeff_width=192, memory_dim=128, layers=[1]), batch=8, seq=256),
    "medium": dict(config=dict(backbone="340m", table_capacity=[32000, 100_000, 100_000], heads_per_order=4,
                               coeff_width=3072, memory_dim=3072, layers=[10]), batch=2, seq=512),
}


class NaiveFactorEngram(FactorEngram):
    """Same module, but the tables are separate nn.Embedding per branch joined by torch.cat."""

    def __init__(self, reference: FactorEngram):
        super().__init__(reference.config, reference.layer_index)
        self.load_state_dict(reference.state_dict())
        layout = self.hasher.layouts[0]
        weight = reference.tables.weight.detach()
        self.branches = nn.ModuleList(
            nn.Embedding.from_pretrained(weight[o:o + rows].clone(), freeze=False)
            for o, rows in zip(layout.offsets, layout.moduli))
        self.offsets = layout.offsets
        del self.tables

    def forward(self, hidden_states, token_ids):
        idx = self.hasher.indices(token_ids)
        z = torch.cat([emb(idx[..., b] - self.offsets[b]) for b, emb in enumerate(self.branches)], -1)
        memory = self.gated_memory(hidden_states, z)
        values = self.value_proj(memory)
        return self.refine(values), z.abs().sum(-1)


def time_fwd_bwd(module, h, ids, steps):
    for _ in range(2):  # warm-up
        m, l1 = module(h, ids)
        (m.sum() + l1.sum()).backward()
    start = time.perf_counter()
    for _ in range(steps):
        module.zero_grad(set_to_none=True)
        m, l1 = module(h, ids)
        (m.sum() + l1.sum()).backward()
    return (time.perf_counter() - start) / steps


@torch.no_grad()
def time_forward(module, h, ids, steps):
    for _ in range(2):  # warm-up
        module(h, ids)
    start = time.perf_counter()
    for _ in range(steps):
        module(h, ids)
    return (time.perf_counter() - start) / steps


def served_copy(module: FactorEngram, table_dtype: str) -> FactorEngram:
    """``module`` with its tables stored in the serving format ``table_dtype``."""
    config = MemoryConfig.from_dict(dict(module.config.to_dict(), table_dtype=table_dtype))
    served = FactorEngram(config, module.layer_index)
    state = module.state_dict()
    served.load_state_dict({k: v for k, v in state.items() if k != "tables.weight"}, strict=False)
    served.tables.store_(state["tables.weight"])
    return served


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--serving", nargs="*", default=[], choices=["bf16", "fp8"],
                        help="serving formats whose forward to time against the baseline's forward")
    args = parser.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    for name in args.sizes:
        spec = SIZES[name]
        cfg = MemoryConfig.from_dict(spec["config"])
        fused = FactorEngram(cfg, cfg.layers[0])
        naive = NaiveFactorEngram(fused)
        h = torch.randn(spec["batch"], spec["seq"], cfg.hidden_size)
        ids = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]))
        torch.testing.assert_close(fused(h, ids)[0], naive(h, ids)[0])
        tokens = spec["batch"] * spec["seq"]
        t_fused = time_fwd_bwd(fused, h, ids, args.steps)
        t_naive = time_fwd_bwd(naive, h, ids, args.steps)
        print(json.dumps(dict(size=name, tokens=tokens, fused_tokens_per_s=round(tokens / t_fused),
                              naive_tokens_per_s=round(tokens / t_naive), speedup=round(t_naive / t_fused, 3))))
        for table_dtype in args.serving:
            served = served_copy(fused, table_dtype)
            t_served = time_forward(served, h, ids, args.steps)
            t_naive = time_forward(naive, h, ids, args.steps)
            print(json.dumps(dict(size=name, tokens=tokens, forward_only=True, tables=table_dtype,
                                  served_tokens_per_s=round(tokens / t_served),
                                  naive_fp32_tokens_per_s=round(tokens / t_naive),
                                  ratio=round(t_naive / t_served, 3))))


if __name__ == "__main__":
    main()
