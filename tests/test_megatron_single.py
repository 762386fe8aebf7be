"""Single-process Megatron checks: the sparsity aux loss, build-time errors, what the branch reads."""

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.configs import tiny_memory_config, tiny_transformer_config
from tests.helpers.megatron import batches, build


@contextlib.contextmanager
def objective_written_out(model, mc):
    """Inside the block the sparsity autoscaler is off (a reference objective carries the term itself)
    and ``forward(batch)`` returns the model's output and the microbatch's lambda * L_sparsity (Eq.
    12-13), from the L1 terms the memory modules return."""
    from fe_megatron.megatron.sparsity import SparsityLossAutoScaler

    l1_terms = []
    hooks = [layer.memory.register_forward_hook(lambda m, i, o: l1_terms.append(o[1]))
             for layer in model.stage_memory_layers]

    def forward(batch):
        l1_terms.clear()
        out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return out, mc.sparsity_lambda * torch.stack([t.mean() for t in l1_terms]).mean()

    SparsityLossAutoScaler.set_loss_scale(0.0)
    try:
        yield forward
    finally:
        SparsityLossAutoScaler.set_loss_scale(1.0)
        for hook in hooks:
            hook.remove()


def test_sparsity_aux_loss_gradients_equal_direct_lm_plus_lambda_l1(megatron_world):
    """Megatron schedule with the aux-loss autoscaler vs. an explicit (LM + lambda * L1) backward."""
    from fe_megatron.megatron.builder import build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.step import lm_loss, pop_sparsity_loss, run_microbatches
    from megatron.core.optimizer import OptimizerConfig

    mc = tiny_memory_config(sparsity_lambda=0.05)
    torch.manual_seed(3)
    model = build(mc)
    cfg = model.config
    ddp = wrap_ddp(model, cfg)
    opt = build_optimizer([ddp], OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0, weight_decay=0.0,
                                                 clip_grad=0.0))
    connect_schedule_hooks(cfg, [ddp], opt)
    data = batches(3)
    ddp.zero_grad_buffer()
    run_microbatches([ddp], data, 32, 2, forward_only=False)
    scheduled = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    reported = pop_sparsity_loss([ddp], len(data))

    # direct: the same objective written out, gradients by one plain backward
    ddp.zero_grad_buffer()  # DDP's hooks accumulate the direct backward into main_grad as well
    total, direct_sparsity = 0.0, 0.0
    with objective_written_out(model, mc) as forward:
        for batch in data:
            out, sparsity = forward(batch)
            total = total + (lm_loss(batch["loss_mask"], out)[0] + sparsity) / len(data)
            direct_sparsity += float(sparsity.detach()) / len(data)
        total.backward()
    model.pop_sparsity_loss()
    for name, p in model.named_parameters():
        torch.testing.assert_close(scheduled[name], p.main_grad, rtol=1e-5, atol=1e-7, msg=name)
    assert reported == pytest.approx(direct_sparsity, rel=1e-6) and reported > 0
    # the tables' gradients really contain the L1 term
    assert all(layer.memory.tables.weight.main_grad.abs().sum() > 0 for layer in model.stage_memory_layers)


def test_per_token_loss_weights_each_microbatch_s_sparsity_term_by_its_tokens(megatron_world):
    """Megatron-LM's --calculate-per-token-loss: each microbatch's LM loss is a sum over its loss-mask
    tokens and finalize_model_grads divides by the step's total. With the sparsity scale of
    `microbatch_gradient_scale(per_token_loss=True)`, the scheduled gradients equal those of the
    reference objective written out: sum over microbatches of (summed LM loss + n_mb * lambda * L_sparsity_mb),
    divided by the step's tokens, on microbatches whose token counts differ widely."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.megatron.builder import build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.sparsity import SparsityLossAutoScaler, microbatch_gradient_scale

    mc = tiny_memory_config(sparsity_lambda=0.05)
    torch.manual_seed(5)
    model = build(mc)
    cfg = model.config
    cfg.calculate_per_token_loss = True
    ddp = wrap_ddp(model, cfg)
    opt = build_optimizer([ddp], OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0, weight_decay=0.0,
                                                 clip_grad=0.0))
    connect_schedule_hooks(cfg, [ddp], opt)
    data = batches(3)
    for batch, keep in zip(data, (0.95, 0.15, 0.5)):  # microbatches of very different token counts
        batch["loss_mask"] = (torch.rand(batch["loss_mask"].shape) < keep).float()
    tokens = [float(batch["loss_mask"].sum()) for batch in data]
    assert min(tokens) > 0 and max(tokens) > 3 * min(tokens)

    def summed_loss(loss_mask, output):
        loss = (output.float() * loss_mask).sum()
        return loss, loss_mask.sum().to(torch.int), {"lm loss": loss.detach().clone()}

    def forward_step(iterator, chunk):
        batch = next(iterator)
        SparsityLossAutoScaler.set_loss_scale(microbatch_gradient_scale(
            len(data), per_token_loss=True, num_tokens=float(batch["loss_mask"].sum())))
        out = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return out, partial(summed_loss, batch["loss_mask"])

    ddp.zero_grad_buffer()
    try:
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(data), model=[ddp],
                                    num_microbatches=len(data), seq_length=32, micro_batch_size=2,
                                    decoder_seq_length=32, forward_only=False)
    finally:
        cfg.calculate_per_token_loss = False
    scheduled = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    model.pop_sparsity_loss()

    ddp.zero_grad_buffer()
    total = 0.0
    with objective_written_out(model, mc) as forward:
        for batch, count in zip(data, tokens):
            out, sparsity = forward(batch)
            total = total + (out.float() * batch["loss_mask"]).sum() + count * sparsity
        (total / sum(tokens)).backward()
    model.pop_sparsity_loss()
    for name, p in model.named_parameters():
        torch.testing.assert_close(scheduled[name], p.main_grad, rtol=1e-5, atol=1e-7, msg=name)
    # and the weighting matters: the mean-per-microbatch scale gives other table gradients
    assert microbatch_gradient_scale(len(data)) != microbatch_gradient_scale(len(data), per_token_loss=True,
                                                                            num_tokens=tokens[1])


@pytest.mark.parametrize("overlap_grad_reduce", [False, True])
def test_tables_accumulate_straight_into_ddp_main_grad(megatron_world, overlap_grad_reduce):
    """Under Megatron's DDP the table backward adds into main_grad itself (no dense table
    gradient, nothing added twice): main_grad after three scheduled microbatches equals the
    dense gradient of plain autograd on an unwrapped copy of the model."""
    from fe_megatron import ops
    from fe_megatron.megatron.builder import build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.step import lm_loss, run_microbatches
    from megatron.core.optimizer import OptimizerConfig

    mc = tiny_memory_config(sparsity_lambda=0.0)
    torch.manual_seed(11)
    model, plain = build(mc), build(mc)
    for layer in model.stage_memory_layers:  # V starts at zero, which would stop every table gradient
        torch.nn.init.normal_(layer.memory.value_proj.weight, std=0.1)
    plain.load_state_dict(model.state_dict())
    data = batches(3)
    with ops.use_backend("torch"):
        total = sum(lm_loss(b["loss_mask"], plain(b["tokens"], b["position_ids"], b["attention_mask"],
                                                  labels=b["labels"]))[0] for b in data) / len(data)
        total.backward()
    plain.pop_sparsity_loss()

    ddp = wrap_ddp(model, model.config, overlap_grad_reduce=overlap_grad_reduce)
    opt = build_optimizer([ddp], OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0, weight_decay=0.0,
                                                 clip_grad=0.0))
    connect_schedule_hooks(model.config, [ddp], opt)
    ddp.zero_grad_buffer()
    run_microbatches([ddp], data, 32, 2, forward_only=False)
    model.pop_sparsity_loss()
    for mine, ref in zip(model.stage_memory_layers, plain.stage_memory_layers):
        weight, expected = mine.memory.tables.weight, ref.memory.tables.weight.grad
        assert weight.grad_added_to_main_grad is True and weight.grad is None
        assert expected.abs().sum() > 0
        torch.testing.assert_close(weight.main_grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["factorengram", "engram"])
def test_megatron_layer_runs_the_one_plain_memory_module(megatron_world, kind):
    """The Megatron layer's ``memory`` is the single-process class itself, with Megatron's
    hooks, and its parameters carry the sharding plan's attributes."""
    from fe_megatron.memory import Engram, FactorEngram
    from fe_megatron.memory.sharding import SHARDING_PLAN

    overrides = dict(kind="engram", gate="scalar", memory_dim=24) if kind == "engram" else {}
    model = build(tiny_memory_config(**overrides))
    assert len(model.stage_memory_layers) == 2
    for layer in model.stage_memory_layers:
        assert type(layer.memory) is {"factorengram": FactorEngram, "engram": Engram}[kind]
        assert type(layer.memory.parallel).__name__ == "MegatronParallelHooks"
        assert layer.memory.layer_index == layer.layer_number - 1
        for name, param in layer.memory.named_parameters():
            plan = SHARDING_PLAN[kind][name]
            assert getattr(param, "is_memory_table", False) == plan.is_table, name
            assert getattr(param, "tensor_model_parallel", False) == plan.tensor_parallel, name


def test_branch_reads_the_pre_norm_residual_stream(megatron_world):
    mc = tiny_memory_config(layers=[1])
    model = build(mc)
    layer = model.stage_memory_layers[0]
    seen = {}
    def record_branch_input(module, inputs, output):
        seen["h"] = inputs[0].detach()

    layer.memory.register_forward_hook(record_branch_input)
    def record_layer_input(module, args, kwargs):
        seen["x"] = kwargs["hidden_states"].detach()

    layer.register_forward_pre_hook(record_layer_input, with_kwargs=True)
    batch = batches(1)[0]
    model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    assert torch.equal(seen["h"], seen["x"])  # the layer input, before input_layernorm


def test_te_spec_branch_sees_same_hidden_state():
    pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed (GPU-only)")
    from fe_megatron.megatron import get_gpt_layer_with_factorengram_spec

    spec = get_gpt_layer_with_factorengram_spec(tiny_memory_config(), backend="te")
    assert spec.params["memory_config"].layers == [1, 2]


def test_te_backend_without_te_names_the_problem():
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine is installed")
    except ImportError:
        pass
    from fe_megatron.megatron import get_gpt_layer_with_factorengram_spec

    with pytest.raises(ImportError, match="backend='te' needs Transformer Engine"):
        get_gpt_layer_with_factorengram_spec(tiny_memory_config(), backend="te")


@pytest.mark.parametrize("memory_overrides, transformer_overrides, fragment", [
    (dict(layers=[1, 2], num_layers=8), {}, r"MemoryConfig.backbone.num_layers=8 does not match "
                                            r"TransformerConfig.num_layers=4"),
    (dict(hidden_size=48), {}, "MemoryConfig.backbone.hidden_size=48 does not match"),
    (dict(placement="inside_ffn"), dict(gated_linear_unit=False, activation_func=F.gelu),
     "placement='inside_ffn' adds the memory to the SwiGLU up-projection"),
    (dict(placement="inside_ffn", ffn_hidden_size=96), {}, "MemoryConfig.backbone.ffn_hidden_size=96 does not match"),
])
def test_bad_configuration_fails_at_build_time(megatron_world, memory_overrides, transformer_overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        build(tiny_memory_config(**memory_overrides), **transformer_overrides)


def test_layer_beyond_model_depth_fails_at_build_time(megatron_world):
    # the config is valid for a 24-layer model, the Megatron model has 4 layers
    mc = tiny_memory_config(num_layers=24, layers=[10, 12])
    with pytest.raises(ValueError, match=r"layer 10 \(0-based\) is beyond the model's num_layers=4"):
        build(mc)


def test_tp_size_must_divide_branch_width():
    from fe_megatron.megatron.transformer_layer import validate_against_transformer_config

    mc = tiny_memory_config(coeff_width=18)  # s_b = 3
    cfg = tiny_transformer_config(tp=2)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 does not divide the branch width s_b=3"):
        validate_against_transformer_config(mc, cfg)


def test_missing_token_ids_on_a_memory_stage(megatron_world):
    model = build(tiny_memory_config())
    batch = batches(1)[0]
    with pytest.raises(ValueError, match="needs input_ids"):
        model(None, batch["position_ids"], batch["attention_mask"], decoder_input=torch.randn(32, 2, 32))


def test_cpu_backend_is_enabled_and_idempotent(megatron_world):
    from fe_megatron.megatron import enable_cpu_backend
    from megatron.core.tensor_parallel import random as mcore_random

    assert enable_cpu_backend() is (not torch.cuda.is_available())
    assert enable_cpu_backend() is (not torch.cuda.is_available())
    if not torch.cuda.is_available():
        state = mcore_random._get_cuda_rng_state()
        assert torch.equal(state, torch.get_rng_state())
        assert torch.zeros(1).type() == "torch.FloatTensor"  # outside megatron.core nothing changes


def test_megatron_lm_spec_module_reads_the_environment(tmp_path):
    import subprocess
    import sys

    code = ("import warnings; warnings.filterwarnings('ignore');"
            "from fe_megatron.megatron import megatron_lm_spec as m;"
            "print(m.factorengram_local_spec.module.__name__, m.memory_config.layers, m.memory_config.hidden_size)")
    env = dict(os.environ, FE_MEMORY_PRESET="factorengram-tiny")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "FactorEngramTransformerLayer" and "[1, 2] 128" in out
    cfg = tmp_path / "m.yaml"
    cfg.write_text("memory:\n  preset: factorengram-tiny\n  layers: [3]\n")
    env = dict(os.environ, FE_MEMORY_CONFIG=str(cfg))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "[3] 128" in out


@pytest.mark.parametrize("table_lr_mult, table_weight_decay_mult", [(1.0, 1.0), (2.0, 0.0)])
def test_megatron_s_parameter_groups_follow_the_rule_the_deepspeed_engine_builds_from(
        megatron_world, table_lr_mult, table_weight_decay_mult):
    """`fe_megatron.training.param_groups` is the one rule: Megatron's optimizer, built from its
    parameter keys, puts every parameter in the group the rule names (DeepSpeed's groups are the rule's)."""
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.megatron.builder import build_optimizer, wrap_ddp
    from fe_megatron.megatron.compat import optimizer_members
    from fe_megatron.training.config import OptimizerArgs
    from fe_megatron.training.param_groups import multipliers

    cfg = tiny_transformer_config()
    ddp = wrap_ddp(build(tiny_memory_config()), cfg)
    optimizer = build_optimizer([ddp], OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1),
                                table_lr_mult=table_lr_mult, table_weight_decay_mult=table_weight_decay_mult)
    placed = {}
    for member in optimizer_members(optimizer):
        for group in member.param_groups:
            for param in group["params"]:
                placed[id(param)] = (group["wd_mult"], group.get("lr_mult", 1.0))
    args = OptimizerArgs(table_lr_mult=table_lr_mult, table_weight_decay_mult=table_weight_decay_mult)
    names = dict(ddp.module.named_parameters())
    assert len(placed) == len(names)
    kinds = set()
    for name, param in names.items():
        rule = multipliers(name, param, args)
        kinds.add(rule)
        assert placed[id(param)] == rule, name
    assert len(kinds) == (2 if (table_lr_mult, table_weight_decay_mult) == (1.0, 1.0) else 3)
