"""Forward+backward tokens/s of the FactorEngram module against a naive implementation.

The baseline keeps one ``nn.Embedding`` per branch and concatenates the lookups with
``torch.cat`` (how a first implementation usually looks); everything after ``z`` is the
same code.  Both are measured in the same run, on the same inputs, after checking that
they produce identical outputs.  ``--serving bf16 fp8`` also times the forward alone (no gradient,
as a served model runs) of the same module with its tables stored in those formats
(`fe_megatron.tables.storage`, read-only), against the baseline's forward.

``--fusion`` times the module with the fused branch (`fe_megatron.ops`, "the fused branch": the default) against
the same module with its equations unfused (``ops.use_fused_branch(False)``; the hash and the gather keep their
kernels), forward and backward, and forward alone without gradients, and counts the bytes autograd keeps per token
for the backward.

``--kernel`` times the fused operator alone (`ops.gated_reconstruction`, forward and backward) against its unfused
composition on ``--device`` in ``--dtype``, at each size's tokens and widths, with the rate of a plain matrix
product of the same shape measured in the same run: the fraction of the device's matmul rate each reaches.

    python benchmarks/bench_memory.py [--sizes small medium] [--steps 10] [--serving bf16 fp8] [--fusion]
    python benchmarks/bench_memory.py --kernel --device cuda --dtype bfloat16 --sizes medium
"""

import argparse
import json
import platform
import time

import torch
import torch.nn as nn

from fe_megatron import ops
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


def saved_bytes_per_token(module, h, ids) -> float:
    """Bytes of the distinct tensors autograd keeps from one forward for its backward, parameters excluded."""
    parameters = {param.untyped_storage().data_ptr() for param in module.parameters()}
    storages = {}

    def keep(tensor):
        if tensor.untyped_storage().data_ptr() not in parameters:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        m, l1 = module(h, ids)
    (m.sum() + l1.sum()).backward()
    module.zero_grad(set_to_none=True)
    return sum(storages.values()) / ids.numel()


def compare_fusion(name: str, module: FactorEngram, h, ids, steps: int) -> dict:
    """The fused branch against its unfused equations, in the same run on the same inputs."""
    tokens = ids.numel()
    row = dict(size=name, tokens=tokens, backend=ops.current_backend(h.device, h.dtype))
    for label, fused in (("fused", True), ("unfused", False)):
        with ops.use_fused_branch(fused):
            row[f"{label}_fwd_bwd_tokens_per_s"] = round(tokens / time_fwd_bwd(module, h, ids, steps))
            row[f"{label}_forward_tokens_per_s"] = round(tokens / time_forward(module, h, ids, steps))
            row[f"{label}_saved_bytes_per_token"] = round(saved_bytes_per_token(module, h, ids))
    row["fwd_bwd_speedup"] = round(row["fused_fwd_bwd_tokens_per_s"] / row["unfused_fwd_bwd_tokens_per_s"], 3)
    row["forward_speedup"] = round(row["fused_forward_tokens_per_s"] / row["unfused_forward_tokens_per_s"], 3)
    return row


def _synchronized(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def time_call(function, steps: int, device: torch.device) -> float:
    """Seconds per call of ``function``, after two untimed calls."""
    sync = _synchronized(device)
    for _ in range(2):
        function()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        function()
    sync()
    return (time.perf_counter() - start) / steps


def compare_kernel(name: str, config: MemoryConfig, tokens: int, steps: int, device: torch.device,
                   dtype: torch.dtype) -> dict:
    """The fused operator against the unfused composition, forward and forward+backward, and as fractions of the
    rate of ``torch.mm`` on a [tokens, d_m] x [d_m, s] product (the shape of each of the operator's GEMMs)."""
    width, memory_dim = config.coeff_width, config.memory_dim
    generator = torch.Generator().manual_seed(0)
    leaves = [(torch.randn(*shape, generator=generator) * scale).to(device, dtype).requires_grad_()
              for shape, scale in (((tokens, width), 0.02), ((tokens, memory_dim), 1.0),
                                   ((width, memory_dim), width ** -0.5))]
    grad = torch.randn(tokens, memory_dim, generator=generator).to(device, dtype)
    a, b = leaves[1].detach(), leaves[2].detach().t().contiguous()
    matmul_s = time_call(lambda: torch.mm(a, b), steps, device)
    row = dict(size=name, tokens=tokens, s=width, d_m=memory_dim, device=device.type, dtype=str(dtype),
               backend=ops.gated_reconstruction_backend(device, dtype),
               matmul_tflops=round(2 * tokens * width * memory_dim / matmul_s / 1e12, 3))
    for label, fused in (("fused", True), ("unfused", False)):
        with ops.use_fused_branch(fused):
            def forward():
                with torch.no_grad():
                    return ops.gated_reconstruction(*leaves, config.hidden_size)

            def forward_backward():
                ops.gated_reconstruction(*leaves, config.hidden_size).backward(grad)
            forward_s = time_call(forward, steps, device)
            both_s = time_call(forward_backward, steps, device)
        gemms = 7 if fused else 6  # the forward's two, the backward's five (one recomputes the gate) or four
        row[f"{label}_forward_ms"] = round(forward_s * 1e3, 3)
        row[f"{label}_fwd_bwd_ms"] = round(both_s * 1e3, 3)
        row[f"{label}_forward_of_matmul_rate"] = round(2 * matmul_s / forward_s, 3)  # two GEMMs' worth of time
        row[f"{label}_fwd_bwd_of_matmul_rate"] = round(gemms * matmul_s / both_s, 3)
    row["fwd_bwd_speedup"] = round(row["unfused_fwd_bwd_ms"] / row["fused_fwd_bwd_ms"], 3)
    return row


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
    parser.add_argument("--fusion", action="store_true",
                        help="time the fused branch against its unfused equations (ops.use_fused_branch(False))")
    parser.add_argument("--kernel", action="store_true",
                        help="time the fused operator alone against its unfused composition (see --device, --dtype)")
    parser.add_argument("--device", default="cpu", help="with --kernel")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="with --kernel")
    args = parser.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    for name in args.sizes:
        spec = SIZES[name]
        cfg = MemoryConfig.from_dict(spec["config"])
        if args.kernel:
            print(json.dumps(compare_kernel(name, cfg, spec["batch"] * spec["seq"], args.steps,
                                            torch.device(args.device), getattr(torch, args.dtype))))
            continue
        fused = FactorEngram(cfg, cfg.layers[0])
        naive = NaiveFactorEngram(fused)
        h = torch.randn(spec["batch"], spec["seq"], cfg.hidden_size)
        ids = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]))
        torch.testing.assert_close(fused(h, ids)[0], naive(h, ids)[0])
        tokens = spec["batch"] * spec["seq"]
        if args.fusion:
            torch.nn.init.normal_(fused.value_proj.weight, std=0.02)  # gradients reach every parameter
            print(json.dumps(compare_fusion(name, fused, h, ids, args.steps)))
            continue
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
