"""Megatron-LM's own trainer as the tests run it: a pretrain_gpt.py command line for the CPU with the
memory's flags, the memory's YAML, a torchrun launch, and the per-step losses a run logs."""

import json
import os
import subprocess
import sys

from tests.helpers.paths import ENDS_CLEANLY
from tests.helpers.torchrun_util import clean_environment, failed_launch, run_in_own_session

STEPS = 12
MEMORY = dict(ngram_orders=[1, 2, 3], heads_per_order=2, table_capacity=[512, 1009, 1013], coeff_width=48,
              memory_dim=32, layers=[1, 3], conv_kernel_size=3, conv_dilation=2)


def megatron_lm_arguments(data, save, memory_yaml=None):
    """An ordinary pretrain_gpt.py command line for the CPU (gloo, no fused kernels), plus the memory."""
    args = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--swiglu", "--normalization", "RMSNorm",
            "--disable-bias-linear", "--position-embedding-type", "rope", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(STEPS), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "2", "--weight-decay", "0.01", "--adam-beta2", "0.999", "--clip-grad", "1.0",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", data["tokenizer"],
            "--data-path", data["prefix"], "--split", "90,5,5", "--eval-interval", "6", "--eval-iters", "1",
            "--save", save, "--save-interval", "6", "--log-interval", "1",
            "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
            "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
            "--no-bias-swiglu-fusion", "--no-rope-fusion"]
    return args + (["--fe-memory-config", memory_yaml] if memory_yaml else [])


def memory_yaml(tmp_path, **changes) -> str:
    path = tmp_path / "memory.yaml"
    path.write_text(json.dumps({**MEMORY, **changes}))
    return str(path)


def launch(module_args: list, nproc: int, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """``torchrun -m MODULE ARGS``; a run expected to succeed goes through ends_cleanly.py, which also
    fails it when a process group outlives its ``main``."""
    module, *args = module_args
    entry = [ENDS_CLEANLY, "--entry", module] if expect_ok else ["-m", module]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *entry, *args]
    proc = run_in_own_session(cmd, clean_environment())
    if expect_ok:
        assert proc.returncode == 0, failed_launch(proc, stderr_tail=5000)
    return proc


def losses(save: str) -> dict:
    """``{step: (lm loss, sparsity loss)}`` from a run's metrics.jsonl (the last record of a step wins)."""
    out = {}
    with open(os.path.join(save, "metrics.jsonl")) as fh:
        for line in fh:
            record = json.loads(line)
            if "lm_loss" in record:
                out[record["step"]] = (record["lm_loss"], record.get("sparsity_loss"))
    return out
