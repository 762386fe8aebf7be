"""The sparsity objective of Eq. 12-13, written once for every model path (the Megatron layer,
the Hugging Face model, the DeepSpeed engine)."""

from typing import Sequence

import torch


def layer_sparsity(l1: torch.Tensor, num_insertion_layers: int) -> torch.Tensor:
    """One insertion layer's term of Eq. 12, ``1/|I| * mean_t ||z_t^(l)||_1``.

    ``l1``: the layer's per-position L1 norms (any shape; every element is one position t, or,
    under tensor parallelism, this rank's share of one).  Summed over the insertion layers this
    is ``L_sparsity``."""
    return l1.float().mean() / num_insertion_layers


def weighted_sparsity(sparsity: torch.Tensor, sparsity_lambda: float) -> torch.Tensor:
    """Eq. 13's second term, ``lambda * L_sparsity`` (of a whole model, or of one layer's term)."""
    return sparsity_lambda * sparsity


def sparsity_loss(l1_per_layer: Sequence[torch.Tensor], loss_mask: torch.Tensor = None) -> torch.Tensor:
    """Eq. 12: ``L_sparsity = 1/T sum_t 1/|I| sum_l ||z_t^(l)||_1``.

    ``l1_per_layer``: one [batch, seq] tensor per insertion layer (as returned by the
    memory modules).  ``loss_mask`` ([batch, seq], optional) restricts the average over
    t to the positions that count for the LM loss.  `weighted_sparsity` gives Eq. 13's term.
    """
    if not l1_per_layer:
        raise ValueError("sparsity_loss needs the L1 terms of at least one insertion layer")
    if loss_mask is None:
        return torch.stack([layer_sparsity(l1, len(l1_per_layer)) for l1 in l1_per_layer]).sum()
    per_position = torch.stack(list(l1_per_layer)).mean(0)
    mask = loss_mask.to(per_position.dtype)
    return (per_position * mask).sum() / mask.sum().clamp_min(1)
