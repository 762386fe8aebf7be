"""What every trainer computes alike for a step: the language-model loss of a microbatch and the
report of a step whose loss or gradient norm is not finite.  fe-pretrain's Megatron engine takes the
mean (`masked_mean`), Megatron-LM's trainer the sum and the token count (`masked_sum`, its loss
function's protocol), the DeepSpeed engine the mean of the per-token cross-entropy of the Hugging Face
model's logits (`per_token_cross_entropy`); all three are these functions.  Nothing here imports
megatron or deepspeed."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_sum(per_token_losses: torch.Tensor, loss_mask: torch.Tensor) -> tuple:
    """``(sum, tokens)``: the next-token losses summed over the positions ``loss_mask`` keeps, and their
    count, both fp32 scalars."""
    mask = loss_mask.reshape(-1).float()
    return (per_token_losses.reshape(-1).float() * mask).sum(), mask.sum()


def masked_mean(per_token_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the positions ``loss_mask`` keeps (Megatron's definition), in fp32."""
    total, tokens = masked_sum(per_token_losses, loss_mask)
    return total / tokens.clamp_min(1)


def per_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's next-token cross-entropy ([positions], fp32) from ``logits`` [..., vocab]: what
    megatron-core's output layer computes for the Megatron models."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")


def nonfinite_microbatch(index: int, lm_loss: float) -> str:
    """This rank's line for microbatch ``index`` whose loss is not finite."""
    return f"rank {torch.distributed.get_rank()} microbatch {index}: lm loss {lm_loss}"


def nonfinite_report(mine: list, lm_loss: float, grad_norm: float) -> list:
    """Every rank's `nonfinite_microbatch` lines (a collective: call it on every rank); when no loss
    was other than finite, the one line that says the gradient norm was not."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    found = [line for part in everyone for line in part]
    return found or [f"every microbatch's loss is finite (mean {lm_loss}) but the gradient norm is {grad_norm}"]
