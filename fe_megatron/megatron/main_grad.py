"""Megatron's fused weight-gradient accumulation for tables the model holds as parameters.

Megatron's DDP gives every parameter a ``main_grad`` (its slot in the gradient buffer) and a
``grad_added_to_main_grad`` flag: a layer that adds its weight gradient into ``main_grad`` itself sets
the flag, and hands autograd a placeholder, which DDP then skips (or, with ``zero_out_wgrad``, adds as
zeros).  A table's row gradients go the same way here: straight into ``main_grad``, with no dense
gradient of the table's size.  The core's kernels know nothing of this: a run registers
`accumulate_into_main_grad` with `fe_megatron.ops.register_weight_gradient_sink` for its length
(`use_main_grad_accumulation`, in the run's `fe_megatron.megatron.patches.PatchScope`); importing
this module registers nothing.
"""

from __future__ import annotations

from typing import Optional

import torch

from fe_megatron import ops
from fe_megatron.megatron.patches import PatchScope


def accumulate_into_main_grad(weight: torch.Tensor, add_row_gradients) -> Optional[torch.Tensor]:
    """Under Megatron's DDP (``weight`` has ``main_grad`` and ``grad_added_to_main_grad``): the rows added
    into ``main_grad``, the flag set, and the placeholder autograd gets returned; None elsewhere."""
    if getattr(weight, "grad_added_to_main_grad", None) is None or getattr(weight, "main_grad", None) is None:
        return None
    add_row_gradients(weight.main_grad)
    weight.grad_added_to_main_grad = True
    placeholder = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return placeholder(weight.shape, dtype=weight.dtype, device=weight.device)


def use_main_grad_accumulation(scope: PatchScope) -> None:
    """Tables' gradients go through `accumulate_into_main_grad` until ``scope`` closes (a scope around
    it that registered it already keeps it registered)."""
    if ops.register_weight_gradient_sink(accumulate_into_main_grad):
        scope.call_on_exit(_stop_main_grad_accumulation)


def _stop_main_grad_accumulation() -> None:
    ops.unregister_weight_gradient_sink(accumulate_into_main_grad)
