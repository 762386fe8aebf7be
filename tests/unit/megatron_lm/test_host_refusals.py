"""`fe_megatron.megatron_lm.arguments.refused_on_this_host`: on a GPU machine, the fused kernels
Megatron-LM's defaults ask for are refused by name where their library is missing, and not where it
is there or where the run does not use them; on a host without a GPU, only the fused kernels this
model would run."""

import argparse
import importlib.util

import pytest

from fe_megatron.megatron_lm import arguments

GPU_DEFAULTS = dict(transformer_impl="local", fp8=None, layernorm_zero_centered_gamma=False, bf16=True, fp16=False,
                    masked_softmax_fusion=True, gradient_accumulation_fusion=True, apply_rope_fusion=True,
                    position_embedding_type="rope", distributed_backend="nccl")


def refused(installed: set, softmax_kernels: bool, **changes) -> list:
    args = argparse.Namespace(**{**GPU_DEFAULTS, **changes})
    real_find_spec = importlib.util.find_spec
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib.util, "find_spec",
                      lambda name, *rest: object() if name in installed else
                      (None if name in ("transformer_engine", "apex", "fused_weight_gradient_mlp_cuda")
                       else real_find_spec(name, *rest)))
        patch.setattr("fe_megatron.megatron.compat.fused_softmax_available", lambda: softmax_kernels)
        return arguments.refused_on_this_host(args, has_cuda=True)


def test_a_gpu_host_without_the_kernel_libraries_names_each_fused_kernel_and_its_flag():
    problems = refused(set(), softmax_kernels=False)
    assert len(problems) == 3, problems
    for flag in ("--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion", "--no-rope-fusion"):
        assert sum(flag in problem for problem in problems) == 1, (flag, problems)


def test_the_flags_given_or_the_libraries_installed_leave_nothing_to_refuse():
    assert refused(set(), softmax_kernels=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                   apply_rope_fusion=False) == []
    # fp32 asks for no fused softmax; a learned position embedding for no fused rope
    assert refused(set(), softmax_kernels=False, bf16=False, gradient_accumulation_fusion=False,
                   position_embedding_type="learned_absolute") == []
    # Apex brings the gradient-accumulation kernel; Transformer Engine's layers bring theirs and the rope
    assert refused({"fused_weight_gradient_mlp_cuda"}, softmax_kernels=True, apply_rope_fusion=False) == []
    assert refused({"transformer_engine"}, softmax_kernels=True, transformer_impl="transformer_engine") == []


# Megatron-LM's defaults for a GPT model shrunk for the CPU, with the flags the host asks for
HOST_DEFAULTS = dict(transformer_impl="local", fp8=None, layernorm_zero_centered_gamma=False, distributed_backend="gloo",
                     profile=False, gradient_accumulation_fusion=False, no_persist_layer_norm=True,
                     masked_softmax_fusion=False, bias_swiglu_fusion=True, apply_rope_fusion=False,
                     use_megatron_fsdp=False, use_cpu_initialization=True)


def test_the_host_refuses_the_swiglu_fusion_only_for_a_swiglu_mlp():
    """GPT-3's recipe (GeLU, learned positions) keeps --bias-swiglu-fusion's default on: its MLP never runs
    that kernel (megatron.training gives it --bias-gelu-fusion's), so nothing is refused; a SwiGLU MLP is."""
    gelu = argparse.Namespace(**HOST_DEFAULTS, swiglu=False)
    assert arguments.refused_on_this_host(gelu, has_cuda=False) == []
    swiglu = argparse.Namespace(**HOST_DEFAULTS, swiglu=True)
    problems = arguments.refused_on_this_host(swiglu, has_cuda=False)
    assert len(problems) == 1 and "add --no-bias-swiglu-fusion" in problems[0], problems
