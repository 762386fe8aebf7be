"""The contract with megatron-core's non-public API (`fe_megatron.megatron.compat`), on the installed
release; `make test` runs it on the oldest supported stack and `make test-newest` on the newest."""

import copy
import importlib.util
import os
import re

import pytest
import torch

from fe_megatron.megatron import compat
from tests.helpers.configs import tiny_memory_config, tiny_transformer_config
from tests.helpers.paths import ROOT


@pytest.mark.parametrize("contract", compat.CONTRACTS, ids=[c.name for c in compat.CONTRACTS])
def test_every_contract_holds_on_the_installed_release(contract):
    contract.check()  # raises UpstreamMoved, naming the release and what moved


def test_the_installed_release_is_in_the_supported_range_and_setup_py_says_the_same():
    assert compat.unsupported_version_message() is None, compat.unsupported_version_message()
    setup_py = open(os.path.join(ROOT, "setup.py")).read()
    pin = re.search(r'"megatron-core(>=[^,"]+),(<[^"]+)"', setup_py)
    assert pin and pin.groups() == compat.SUPPORTED_MEGATRON_CORE, (pin and pin.groups(), compat.SUPPORTED_MEGATRON_CORE)


def test_version_range_edges():
    assert compat.is_supported_version("0.16.1") and compat.is_supported_version("0.19.2+456be7f")
    assert not compat.is_supported_version("0.16.0") and not compat.is_supported_version("0.20.0rc1")


def test_a_moved_internal_is_named_with_the_release_and_the_file_to_adapt(monkeypatch):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    monkeypatch.delattr(TransformerLayer, "_forward_attention")
    problems = compat.broken_contracts()
    assert len(problems) == 1, problems
    assert "TransformerLayer._forward_attention is gone" in problems[0]
    assert compat.megatron_core_version() in problems[0] and "fe_megatron/megatron/compat/" in problems[0]


def _model(seed=3, clip_grad=1.0, memory_config=None, plain=False):
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp

    torch.manual_seed(seed)
    cfg = tiny_transformer_config()
    model = build_gpt_model(cfg, 128, 32, None if plain else (memory_config or tiny_memory_config()))
    ddp = wrap_ddp(model, cfg)
    optimizer = build_optimizer([ddp], OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01,
                                                       clip_grad=clip_grad), table_lr_mult=2.0)
    connect_schedule_hooks(cfg, [ddp], optimizer)
    return model, ddp, optimizer


def _batches(n, seq=32, mbs=2, seed=0):
    from fe_megatron.megatron.step import causal_mask

    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 128, (mbs, seq + 1), generator=generator)
        out.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(mbs, seq),
                        position_ids=torch.arange(seq).expand(mbs, seq), attention_mask=causal_mask(seq)))
    return out


@pytest.mark.parametrize("clip_grad", [0.05, 0.0], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("plain", [False, True], ids=["memory", "transformer"])
def test_one_norm_per_step_updates_exactly_as_megatrons_own_step(megatron_world, clip_grad, plain):
    """`train_step` prepares the gradients and computes their norm once, and its update is Megatron's
    ``optimizer.step()`` bit for bit (clipping active and not; a chain with the tables' member, and the
    plain Transformer's optimizer), over a few steps."""
    from fe_megatron.megatron.step import run_microbatches, train_step

    ours, ours_ddp, ours_opt = _model(clip_grad=clip_grad, plain=plain)
    theirs, theirs_ddp, theirs_opt = _model(clip_grad=clip_grad, plain=plain)
    calls = {"prepare_grads": 0, "get_grad_norm": 0}
    for name in calls:
        original = getattr(ours_opt, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(ours_opt, name, counted)
    for step in range(3):
        data = _batches(2, seed=step)
        result = train_step([ours_ddp], ours_opt, copy.deepcopy(data), 32, 2, check_finite=True)
        theirs_ddp.zero_grad_buffer()
        theirs_opt.zero_grad()
        run_microbatches([theirs_ddp], copy.deepcopy(data), 32, 2, forward_only=False)
        updated, norm, _ = theirs_opt.step()
        assert result.updated and updated
        if norm is not None:
            assert result.grad_norm == pytest.approx(float(norm), rel=1e-12)
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(a, b), f"step {step}: {name} differs from Megatron's own step"
    assert calls == {"prepare_grads": 3, "get_grad_norm": 3}


def test_a_non_finite_gradient_applies_no_update(megatron_world):
    from fe_megatron.megatron.step import train_step

    model, ddp, optimizer = _model()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    table = next(param for name, param in model.named_parameters() if "tables" in name)
    prepare_grads = optimizer.prepare_grads

    def poisoned_prepare_grads():
        table.main_grad.view(-1)[7] = float("nan")  # as a bad row's gradient would arrive
        return prepare_grads()

    optimizer.prepare_grads = poisoned_prepare_grads
    result = train_step([ddp], optimizer, _batches(2), 32, 2, check_finite=True)
    assert not result.updated and result.nonfinite, result
    assert "gradient norm is nan" in result.nonfinite[0]
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed on a step with a nan gradient"


def test_post_mlp_without_the_upstream_step_is_the_same_bias_dropout_add(megatron_world, monkeypatch):
    """Releases after 0.19 drop ``TransformerLayer._forward_post_mlp``; `compat.post_mlp` then does its work."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    model, _, _ = _model()
    layer = model.decoder.layers[0]
    residual = torch.randn(8, 2, layer.config.hidden_size)
    mlp_out = (torch.randn(8, 2, layer.config.hidden_size), None)
    upstream = compat.post_mlp(layer, mlp_out, residual)
    if hasattr(TransformerLayer, "_forward_post_mlp"):
        monkeypatch.delattr(TransformerLayer, "_forward_post_mlp")
    assert torch.equal(compat.post_mlp(layer, mlp_out, residual), upstream)


def test_the_cpu_backend_answers_cuda_streams_and_events(megatron_world):
    """megatron-core 0.19's DDP waits on ``torch.cuda.current_stream()`` in every gradient sync."""
    if torch.cuda.is_available():
        pytest.skip("the CPU backend is off on a machine with CUDA")
    from megatron.core.distributed import param_and_grad_buffer

    cuda = param_and_grad_buffer.torch.cuda
    stream = cuda.current_stream()
    stream.wait_event(cuda.Event())
    stream.wait_stream(cuda.Stream())
    with cuda.stream(stream):
        pass
    assert cuda.Event().query() and not cuda.is_current_stream_capturing()


def test_fused_softmax_is_asked_for_only_where_its_kernels_are_installed(monkeypatch):
    """Megatron-Core fails in bf16 when masked_softmax_fusion is set and scaled_masked_softmax_cuda
    is missing (seen on a GPU without apex or Megatron-LM's fused kernels)."""
    from fe_megatron.megatron.engine import transformer_config_for
    from fe_megatron.training.config import TrainConfig

    cfg = TrainConfig()
    assert not transformer_config_for(cfg, on_gpu=False).masked_softmax_fusion
    installed = {"scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in installed else find_spec(name, *a))
    assert compat.fused_softmax_available()
    assert transformer_config_for(cfg, on_gpu=True).masked_softmax_fusion
    installed.clear()
    assert not compat.fused_softmax_available()
    assert not transformer_config_for(cfg, on_gpu=True).masked_softmax_fusion
