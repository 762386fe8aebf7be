"""`fe_megatron.megatron.builder` in one process: the tables accumulate straight into DDP's main_grad,
and Megatron's optimizer groups follow the parameter-group rule the DeepSpeed engine builds from."""

import pytest
import torch

from tests.helpers.configs import tiny_memory_config, tiny_transformer_config
from tests.helpers.megatron import batches, build


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
