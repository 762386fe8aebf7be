"""The GPU tier: every GPU-specific path of fe_megatron, one test per step, in the order of their value to a GPU lent
for minutes (15 in all, its start included): first what only a GPU can show (the method's quality at a size
a CPU cannot train), then what was never completed on one (the Llama-3 recipe's bf16 resume, the whole 340M
preset, the table storages), then what checks the kernels, and last what earlier GPU runs measured already
(benchmarks/RESULTS.md). `make gpu-check` runs it and writes ``gpu_results/gpu_check.{json,md}`` (rewritten
as each step, and each run of a step, ends); `make gpu-check-dry` runs every step on CPU at a tiny size.

A step that the time budget leaves out is skipped, and recorded as ``not run``, by name."""

import pytest
import torch

from tests.gpu import check
from tests.gpu.conftest import outcome, require

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() or check.Target.from_environment().dry),
    reason="needs a CUDA device; `make gpu-check-dry` runs these steps on CPU at a tiny size")]


def test_environment(checker, target):
    """The GPU, torch, CUDA, Triton (``nvidia-smi`` into the log)."""
    require(outcome(checker, "environment", lambda: check.environment(checker, target)))


def test_kernels_build(built):
    """``setup.py build_ext --inplace`` for this GPU, and the cuda backend loads."""
    require(built)


def test_the_method_where_it_matters_factorengram_engram_and_the_transformer(checker, target, data, kernels):
    """FactorEngram, Engram with unigrams and the Transformer, 28M-parameter backbones, trained on the same tokens for
    about 3 minutes each in bf16: validation and test perplexity (`check.method`)."""
    require(outcome(checker, "method", lambda: check.method(checker, target, *data)))


def test_llama3_recipe_trains_in_bf16_and_resumes(checker, target, data, kernels):
    """Megatron-LM's Llama-3 8B recipe with FactorEngram: 2 layers at full width, 2 steps, resumed for a third."""
    require(outcome(checker, "llama3-recipe", lambda: check.llama3_recipe(checker, target, *data)))


def test_whole_340m_preset_in_bf16_against_its_backbone(checker, target, kernels):
    """The factorengram-340m preset (Table 8) against the same backbone without memory: step time,
    tokens/s, and their ratio beside the matmul bound."""
    require(outcome(checker, "train-bench-340m", lambda: check.train_bench(checker, target, "340m")))


def test_every_table_storage_trains_and_bf16_state_halves_the_bytes(checker, target, kernels):
    """bench_table_storage.py: peak memory and tokens/s per table storage, the host tier's lookahead."""
    require(outcome(checker, "table-storage", lambda: check.table_storage(checker, target)))


def test_one_memory_layer_at_340m_width_against_the_plain_layer(checker, target, kernels):
    require(outcome(checker, "train-bench-340m-layer", lambda: check.train_bench(checker, target, "340m-layer")))


def test_cuda_and_triton_kernels_match_the_reference(checker, target, kernels):
    require(outcome(checker, "kernel-tests", lambda: check.kernel_tests(checker, target)))


def test_kernel_bandwidth_in_fp32_and_bf16(checker, target, kernels):
    """bench_kernels.py: every kernel's time, gather and row backward as fractions of copy bandwidth."""
    require(outcome(checker, "kernel-bench", lambda: check.kernel_bench(checker, target)))


def test_the_fused_branch_against_its_unfused_equations(checker, target, kernels):
    """bench_memory.py --kernel: the Triton gated reconstruction's time and matmul-rate fraction at 340M widths."""
    require(outcome(checker, "fused-branch-bench", lambda: check.fused_branch_bench(checker, target)))


def test_pretraining_curves_on_the_gpu_follow_the_cpu_reference(pretrain_runs):
    """bf16 (local spec), bf16 with host-tier bf16 tables, and fp32 with the CUDA kernels, against fp32 on
    the CPU from the same initial weights: fp32 within 1e-3, bf16 within 1e-2 (5e-2 with Transformer Engine's
    spec, which starts from its own weights)."""
    require(pretrain_runs[0])


def test_hybrid_model_with_memory_matches_the_gpt_model(checker, target, kernels):
    """bench_hybrid.py: HybridModel with a ``*-`` pattern and memory against the GPT model with memory, the
    same weights: LM losses within 1e-5 in fp32 (5e-3 in bf16), and the tokens/s of each."""
    require(outcome(checker, "hybrid", lambda: check.hybrid_vs_gpt(checker, target)))


def test_converted_model_generates_the_same_tokens_on_gpu_and_cpu(checker, target, pretrain_runs):
    entry, run_dir = pretrain_runs
    if run_dir is None:
        require(checker.not_run("hf-generate", "no GPU fp32 pretraining run to convert"))
    require(outcome(checker, "hf-generate", lambda: check.hf_generate(checker, target, run_dir)))


def test_deepspeed_zero3_in_bf16_follows_the_cpu_reference(checker, target, data, start):
    require(outcome(checker, "deepspeed-zero3", lambda: check.deepspeed_zero3(checker, target, *data, start[0])))
