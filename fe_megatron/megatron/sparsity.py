"""The sparsity term of Eq. 12-13 as an auxiliary loss that leaves the LM loss path unchanged.

Like Megatron's MoE load-balancing loss (`MoEAuxLossAutoScaler`), the aux loss is attached to
the layer output by an autograd function that is the identity in forward and, in backward,
seeds the aux loss with one scale (instead of a second ``backward`` call).  The scale is set
once per step, for every layer, with `SparsityLossAutoScaler.set_loss_scale`, and it must match
how the LM loss is reduced:

* Megatron schedules divide each microbatch's mean LM loss by ``num_microbatches`` and multiply
  it by the context-parallel size: the scale is ``cp_size / num_microbatches``
  (`fe_megatron.megatron.step.run_microbatches` sets it).
* Data-parallel averaging then applies to both terms alike (DDP averages gradients).
* Per-token loss (Megatron-LM's ``--calculate-per-token-loss``): each microbatch's LM loss is a sum
  over its tokens, and ``finalize_model_grads`` divides every gradient by the step's token count
  (over data- and context-parallel ranks). The sparsity term, a mean over the microbatch's
  positions, is then scaled by the microbatch's own token count, so that microbatches weigh in
  by their tokens in both terms (`microbatch_gradient_scale`).

The scale is read when a layer attaches its term (in forward, or in the recomputation of a fully
recomputed layer), so a scale set per microbatch stays with that microbatch when a pipeline
schedule runs later microbatches' forwards before its backward.
* With tensor parallelism each rank adds the L1 of its own coefficient columns, so the sum over
  TP ranks is the full ``||z_t||_1``: no extra communication.
"""

import torch


class SparsityLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; backward feeds ``main_loss_backward_scale`` as the gradient of ``aux_loss``."""

    main_loss_backward_scale: float = 1.0
    # the weight of a term in the logged value: its microbatch's loss tokens under per-token loss, 1 otherwise
    log_weight: float = 1.0

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        ctx.scale = SparsityLossAutoScaler.main_loss_backward_scale  # this microbatch's, whenever backward runs
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale)

    @staticmethod
    def set_loss_scale(scale: float, log_weight: float = 1.0) -> None:
        """The gradient the aux loss of every memory layer that runs from now on receives (set once
        per step, or before each microbatch's forward where it differs by microbatch), and the weight its
        value is logged with (`pop_sparsity_loss` in `fe_megatron.megatron.step`: the microbatch's loss
        tokens under per-token loss, so that the log shows the token-weighted mean the gradient follows)."""
        SparsityLossAutoScaler.main_loss_backward_scale = float(scale)
        SparsityLossAutoScaler.log_weight = float(log_weight)


def microbatch_gradient_scale(num_microbatches: int, cp_size: int = 1, per_token_loss: bool = False,
                              num_tokens: float = 0.0, loss_scale: float = 1.0) -> float:
    """The gradient a microbatch's sparsity term (Eq. 12-13) receives, reduced as Megatron's schedules
    reduce the LM loss: ``loss_scale * cp_size / num_microbatches`` for the mean per microbatch, and
    ``loss_scale * num_tokens`` with per-token loss, where ``num_tokens`` is the microbatch's count of
    loss-mask tokens on this rank (``finalize_model_grads`` then divides by the step's total).
    ``loss_scale``: the fp16 loss scale (``config.grad_scale_func``), 1 otherwise."""
    if per_token_loss:
        return float(loss_scale) * float(num_tokens)
    return float(loss_scale) * cp_size / num_microbatches


def attach_sparsity_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    if not aux_loss.requires_grad:
        return output
    return SparsityLossAutoScaler.apply(output, aux_loss)


def pop_stage_sparsity_loss(layers) -> torch.Tensor:
    """lambda * L_sparsity summed over a pipeline stage's memory ``layers`` (each a
    `fe_megatron.megatron.transformer_layer.HostsMemory`) and the microbatches run since the last call,
    for this rank's TP share; sum over TP and PP ranks for the model's value."""
    total = torch.zeros(())
    for layer in layers:
        value = layer.pop_tracked_sparsity_loss()
        if value is not None:
            total = total + value.float().cpu()
    return total
