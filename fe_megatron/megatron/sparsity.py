"""The sparsity term of Eq. 12-13 as an auxiliary loss that leaves the LM loss path unchanged.

Like Megatron's MoE load-balancing loss, the aux loss is attached to the layer output by
an autograd function that is the identity in forward and, in backward, seeds the aux
loss with ``scale`` (instead of a second ``backward`` call).  ``scale`` must match how
the LM loss is reduced:

* Megatron schedules divide each microbatch's mean LM loss by ``num_microbatches``; the
  model is told the same number with
  `FactorEngramGPTModel.set_sparsity_loss_scale(1 / num_microbatches)`.
* Data-parallel averaging then applies to both terms alike (DDP averages gradients).
* With tensor parallelism each rank adds the L1 of its own coefficient columns, so the
  sum over TP ranks is the full ``||z_t||_1``: no extra communication.
"""

import torch


class SparsityLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; backward feeds ``scale`` as the gradient of ``aux_loss``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def attach_sparsity_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    if not aux_loss.requires_grad or scale == 0:
        return output
    return SparsityLossAutoScaler.apply(output, aux_loss, scale)
