"""The learning rate at each step: linear warmup from 0, then cosine decay to ``min_lr`` over the
run, exactly as megatron.core's ``OptimizerParamScheduler`` computes it for fe-pretrain's Megatron
engine (``init_lr=0``, ``lr_decay_style="cosine"``, ``lr_decay_steps=train_steps``), so that the
DeepSpeed engine follows the same schedule without importing megatron."""

from __future__ import annotations

import math


def learning_rate(step: int, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """The rate of optimizer step ``step`` (0-based: the first update uses ``step=0``)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    if step > decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / (decay_steps - warmup_steps)
    return min_lr + (max_lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)
