"""The parameter-group rule both engines' optimizers follow (Megatron-LM's): no weight decay on
biases and 1-D tensors (norm weights), and the memory tables in a group of their own with
``optimizer.table_lr_mult`` and ``table_weight_decay_mult``.  The Megatron engine states it as
megatron-core's parameter keys (`fe_megatron.megatron.builder.build_optimizer`), the DeepSpeed
engine as torch parameter groups (`parameter_groups`); `tests/unit/megatron/test_builder.py` checks
that Megatron's keys put every parameter where the rule does.  Nothing here imports megatron or deepspeed."""

from __future__ import annotations

import fnmatch

import torch

NO_DECAY_NAMES = "*.bias"  # and every 1-D tensor
TABLE_ATTRIBUTE = "is_memory_table"  # what the Megatron layers mark a table with
TABLE_NAME_SUFFIX = "memory.tables.weight"


def without_weight_decay(name: str, param: torch.Tensor) -> bool:
    return fnmatch.fnmatch(name, NO_DECAY_NAMES) or param.dim() == 1


def is_table(name: str, param: torch.Tensor) -> bool:
    return getattr(param, TABLE_ATTRIBUTE, False) or name.endswith(TABLE_NAME_SUFFIX)


def multipliers(name: str, param: torch.Tensor, optimizer_args) -> tuple:
    """``(wd_mult, lr_mult)`` of parameter ``name``."""
    if is_table(name, param):
        return optimizer_args.table_weight_decay_mult, optimizer_args.table_lr_mult
    return (0.0 if without_weight_decay(name, param) else 1.0), 1.0


def parameter_groups(model: torch.nn.Module, optimizer_args) -> list:
    """torch optimizer groups of ``model``'s trainable parameters by the rule, each with its
    ``wd_mult`` and ``lr_mult`` (which the learning-rate schedule reads) and its weight decay."""
    groups = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault(multipliers(name, param, optimizer_args), []).append(param)
    return [{"params": params, "wd_mult": wd_mult, "lr_mult": lr_mult,
             "weight_decay": optimizer_args.weight_decay * wd_mult} for (wd_mult, lr_mult), params in groups.items()]
