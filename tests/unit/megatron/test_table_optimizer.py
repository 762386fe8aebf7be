"""The tables' member of Megatron's optimizer chain (`fe_megatron.megatron.table_optimizer`): whole fp32 tables
trained from stores by the table optimizer's one-pass AdamW (fe-pretrain's rule without the distributed
optimizer, `fe_megatron.tables.plan`) follow Megatron's own Adam over them as its parameters."""

import pytest
import torch

from tests.helpers.configs import tiny_memory_config
from tests.helpers.megatron import batches, build


def train(one_pass: bool, steps: int = 4) -> tuple:
    """``(losses, final tables)`` of the tiny GPT with memory, seed 3, trained ``steps`` steps on the same batches,
    its tables in stores (``one_pass``) or as Megatron's parameters."""
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.megatron.builder import build_optimizer, wrap_ddp
    from fe_megatron.megatron.step import train_step
    from fe_megatron.megatron.table_optimizer import manage_tables
    from fe_megatron.memory.branch import memory_branches
    from fe_megatron.tables.plan import TablePlan
    from fe_megatron.training.config import OptimizerArgs

    torch.manual_seed(3)
    model = build(tiny_memory_config())
    initial = [branch.tables.weight.detach().clone() for branch in memory_branches(model).values()]
    settings = dict(lr=3e-3, weight_decay=0.01, beta1=0.9, beta2=0.95, eps=1e-8, clip_grad=1.0)
    plan = TablePlan.resolve(one_pass_adamw=one_pass)
    assert plan.in_stores == one_pass
    tables = manage_tables(model, OptimizerArgs(**settings), plan, "cpu", seed=1) if one_pass else None
    ddp = wrap_ddp(model, model.config)
    optimizer = build_optimizer([ddp], OptimizerConfig(
        optimizer="adam", lr=settings["lr"], weight_decay=settings["weight_decay"], adam_beta1=settings["beta1"],
        adam_beta2=settings["beta2"], adam_eps=settings["eps"], clip_grad=settings["clip_grad"]), tables=tables)
    torch.manual_seed(5)
    data = [batches(2) for _ in range(steps)]
    losses = [train_step([ddp], optimizer, step, 32, 2).lm_loss for step in data]
    final = [branch.tables.weight.detach().clone() for branch in memory_branches(model).values()] if tables is None \
        else [store.weight.detach().clone() for store in tables.stores.values()]
    assert all(not torch.equal(before, after) for before, after in zip(initial, final))  # every table trained
    return losses, final


def test_one_pass_adamw_over_stores_follows_megatron_s_adam_over_the_parameters(megatron_world):
    """The same losses over 4 steps (clipping and weight decay on) and the same tables after them, to fp32
    rounding: both take Adam's step per element; the table optimizer fuses it into one pass over each row."""
    engine_losses, engine_tables = train(one_pass=False)
    stores_losses, stores_tables = train(one_pass=True)
    assert stores_losses == pytest.approx(engine_losses, rel=1e-6) and len(set(engine_losses)) == 4
    assert len(engine_tables) == len(stores_tables) == 2
    for engine, stores in zip(engine_tables, stores_tables):
        torch.testing.assert_close(stores, engine, rtol=1e-5, atol=1e-7)
