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
* With tensor parallelism each rank adds the L1 of its own coefficient columns, so the sum over
  TP ranks is the full ``||z_t||_1``: no extra communication.
"""

import torch


class SparsityLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; backward feeds ``main_loss_backward_scale`` as the gradient of ``aux_loss``."""

    main_loss_backward_scale: float = 1.0

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, SparsityLossAutoScaler.main_loss_backward_scale)

    @staticmethod
    def set_loss_scale(scale: float) -> None:
        """The gradient every memory layer's aux loss receives, from now on (set once per step)."""
        SparsityLossAutoScaler.main_loss_backward_scale = float(scale)


def attach_sparsity_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    if not aux_loss.requires_grad:
        return output
    return SparsityLossAutoScaler.apply(output, aux_loss)
