"""Helpers shared by the torchrun-launched equivalence scripts; the tiny GPT's configurations are the
tests' own (tests/helpers/configs.py)."""

import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

# run as a script (sys.path[0] is this folder): the repository root, for the tests' helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.helpers.configs import tiny_memory_config, tiny_transformer_config  # noqa: E402,F401 - for the scripts


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


def build_hybrid_model(cfg, mc, seq: int, table_sharding: str = "replicated"):
    """The hybrid model whose ``*-`` pairs are the tiny GPT's layers, with its memory."""
    import dataclasses

    from megatron.core import parallel_state

    from fe_megatron.megatron.hybrid_model import FactorEngramHybridModel
    from fe_megatron.megatron.hybrid_specs import local_hybrid_stack_spec

    pattern = "*-" * cfg.num_layers
    cfg = dataclasses.replace(cfg, num_layers=len(pattern))
    return FactorEngramHybridModel(cfg, local_hybrid_stack_spec(), 128, seq, pattern, mc, table_sharding=table_sharding,
                                   pre_process=parallel_state.is_pipeline_first_stage(),
                                   post_process=parallel_state.is_pipeline_last_stage(),
                                   position_embedding_type="rope", share_embeddings_and_output_weights=True)
