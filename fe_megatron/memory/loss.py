"""The sparsity objective of Eq. 12-13."""

from typing import Sequence

import torch


def sparsity_loss(l1_per_layer: Sequence[torch.Tensor], loss_mask: torch.Tensor = None) -> torch.Tensor:
    """Eq. 12: ``L_sparsity = 1/T sum_t 1/|I| sum_l ||z_t^(l)||_1``.

    ``l1_per_layer``: one [batch, seq] tensor per insertion layer (as returned by the
    memory modules).  ``loss_mask`` ([batch, seq], optional) restricts the average over
    t to the positions that count for the LM loss.  Multiply by ``sparsity_lambda``
    for Eq. 13.
    """
    if not l1_per_layer:
        raise ValueError("sparsity_loss needs the L1 terms of at least one insertion layer")
    per_position = torch.stack(list(l1_per_layer)).mean(0)
    if loss_mask is None:
        return per_position.mean()
    mask = loss_mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1)
