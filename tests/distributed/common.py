"""Helpers shared by the torchrun-launched equivalence scripts."""

import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (0 when both are zero)."""
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


class Checker:
    """Collects failures across ranks; `finish()` exits non-zero on any rank's failure."""

    def __init__(self):
        self.failures = []
        self.checks = 0

    def close(self, name: str, actual, expected, tol: float = 1e-5):
        self.checks += 1
        if actual.shape != expected.shape:
            self.failures.append(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
            return
        err = rel_err(actual.detach().double(), expected.detach().double())
        if not err <= tol:
            self.failures.append(f"{name}: relative error {err:.3e} > {tol:.0e}")

    def equal(self, name: str, actual, expected):
        self.checks += 1
        if not torch.equal(actual, expected):
            self.failures.append(f"{name}: not bit-identical")

    def true(self, name: str, condition: bool):
        self.checks += 1
        if not condition:
            self.failures.append(name)

    def finish(self):
        """Report every rank's failures, tear down the process groups, exit non-zero on any failure."""
        from fe_megatron.megatron.parallel import shutdown

        rank = dist.get_rank()
        flag = torch.tensor([len(self.failures)], dtype=torch.int64)
        dist.all_reduce(flag)
        for failure in self.failures:
            print(f"[rank {rank}] FAIL {failure}", flush=True)
        if rank == 0:
            print(f"{self.checks} checks on rank 0, {int(flag)} failures over all ranks", flush=True)
        dist.barrier()
        shutdown()
        sys.exit(1 if int(flag) else 0)


def tiny_transformer_config(tp=1, pp=1, sp=False, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
                  bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
                  masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                  use_cpu_initialization=True, persist_layer_norm=False, tensor_model_parallel_size=tp,
                  pipeline_model_parallel_size=pp, sequence_parallel=sp, pipeline_dtype=torch.float32)
    values.update(overrides)
    return TransformerConfig(**values)


def tiny_memory_config(**overrides):
    """The memory of the tiny test GPT (backbone fields may be overridden too)."""
    from fe_megatron.config import BACKBONE_FIELDS, BackboneConfig, MemoryConfig

    values = dict(vocab_size=128, hidden_size=32, num_layers=4, num_attention_heads=4, ffn_hidden_size=64,
                  ngram_orders=[1, 2, 3], heads_per_order=2, table_capacity=[128, 401, 409], coeff_width=24,
                  memory_dim=16, layers=[1, 2], conv_kernel_size=4, conv_dilation=3, sparsity_lambda=1e-2)
    values.update(overrides)
    backbone = BackboneConfig(**{name: values.pop(name) for name in BACKBONE_FIELDS if name in values})
    return MemoryConfig(backbone=backbone, **values)
