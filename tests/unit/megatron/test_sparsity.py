"""`fe_megatron.megatron.sparsity` in one process: the sparsity aux loss's gradients are those of the
objective written out (LM + lambda * L1, Eq. 12-13), also with the per-token loss."""

import contextlib

import pytest
import torch

from tests.helpers.configs import tiny_memory_config
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
    divided by the step's tokens, on microbatches whose token counts differ widely. The logged sparsity loss
    is that objective's sparsity part (the token-weighted mean), not the plain mean over microbatches."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.megatron.builder import build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.sparsity import SparsityLossAutoScaler, microbatch_gradient_scale
    from fe_megatron.megatron.step import pop_sparsity_loss

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
        count = float(batch["loss_mask"].sum())  # as fe_megatron.megatron_lm.steps.forward_step sets them
        SparsityLossAutoScaler.set_loss_scale(microbatch_gradient_scale(len(data), per_token_loss=True,
                                                                        num_tokens=count), log_weight=count)
        out = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return out, partial(summed_loss, batch["loss_mask"])

    ddp.zero_grad_buffer()
    try:
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(data), model=[ddp],
                                    num_microbatches=len(data), seq_length=32, micro_batch_size=2,
                                    decoder_seq_length=32, forward_only=False)
    finally:
        cfg.calculate_per_token_loss = False
        SparsityLossAutoScaler.set_loss_scale(1.0)
    scheduled = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    reported = pop_sparsity_loss([ddp], len(data), loss_tokens=sum(tokens))

    ddp.zero_grad_buffer()
    total, weighted, terms = 0.0, 0.0, []
    with objective_written_out(model, mc) as forward:
        for batch, count in zip(data, tokens):
            out, sparsity = forward(batch)
            total = total + (out.float() * batch["loss_mask"]).sum() + count * sparsity
            weighted += count * float(sparsity.detach()) / sum(tokens)
            terms.append(float(sparsity.detach()))
        (total / sum(tokens)).backward()
    model.pop_sparsity_loss()
    for name, p in model.named_parameters():
        torch.testing.assert_close(scheduled[name], p.main_grad, rtol=1e-5, atol=1e-7, msg=name)
    assert reported == pytest.approx(weighted, rel=1e-6), (reported, weighted, terms)
    assert abs(weighted - sum(terms) / len(terms)) > 1e-4 * weighted  # the weighting shows in the log
    # and the weighting matters: the mean-per-microbatch scale gives other table gradients
    assert microbatch_gradient_scale(len(data)) != microbatch_gradient_scale(len(data), per_token_loss=True,
                                                                            num_tokens=tokens[1])
