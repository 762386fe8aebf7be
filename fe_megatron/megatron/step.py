"""One training or evaluation step through Megatron's pipeline schedules."""

from __future__ import annotations

import math
from functools import partial
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from fe_megatron.megatron import compat
from fe_megatron.megatron.sparsity import SparsityLossAutoScaler
from fe_megatron.tables import lookahead
from fe_megatron.megatron.batch import Microbatch, forward_microbatch
from fe_megatron.tables.lookahead import MicrobatchLookups
from fe_megatron.training.losses import masked_mean, nonfinite_microbatch, nonfinite_report
from fe_megatron.training.distributed import current_device
from fe_megatron.training.run import StepResult


def causal_mask(seq_length: int, device=None) -> torch.Tensor:
    """Megatron's boolean mask (True = masked) for causal attention, built on ``device``
    (passing it avoids megatron's default mask, which is built on CUDA)."""
    return torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)


def lm_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean next-token loss over unmasked positions; the schedule divides it by the microbatch count."""
    loss = masked_mean(output_tensor, loss_mask)
    # clone: the schedule divides the returned loss by the microbatch count in place
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """Batches are dicts with ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, ``attention_mask``
    (all ``[b, s]`` but the mask), run as a `Microbatch` (`forward_microbatch`, the forward Megatron-LM's
    trainer runs too). Every pipeline stage receives the tokens: memory layers need them. With the host tier
    the iterator is a `MicrobatchLookups`: each batch brings its started lookups, and the next microbatch's
    start once this forward is issued."""
    batch = Microbatch.of(next(data_iterator))
    output = forward_microbatch(model, batch)
    if isinstance(data_iterator, MicrobatchLookups):
        data_iterator.start_next()
    return output, partial(lm_loss, batch.loss_mask)


def _unwrap(chunk):
    """The model inside DDP (and any other ``.module`` wrappers)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def pop_sparsity_loss(model_chunks: list, num_microbatches: int, loss_tokens: Optional[float] = None) -> float:
    """lambda * L_sparsity for the ``num_microbatches`` microbatches since the last call, averaged
    over them and over data-parallel ranks, summed over TP shares and pipeline stages.

    ``loss_tokens``: under per-token loss (Megatron-LM's ``--calculate-per-token-loss``), this rank's loss
    tokens over those microbatches (0 on a stage that reads no loss mask), each microbatch's term having
    been tracked times its own tokens (`SparsityLossAutoScaler.set_loss_scale`): the value is then the
    token-weighted mean over microbatches and data- and context-parallel ranks, the objective whose
    gradient the step took (`microbatch_gradient_scale`), not the plain mean."""
    total = torch.zeros(())
    for chunk in model_chunks:
        inner = _unwrap(chunk)
        if hasattr(inner, "pop_sparsity_loss"):
            total = total + inner.pop_sparsity_loss()
    total = total.reshape(1).to(current_device())
    torch.distributed.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    if loss_tokens is None:
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
        return float(total) / (num_microbatches * parallel_state.get_data_parallel_world_size())
    tokens = torch.tensor([float(loss_tokens)], device=total.device)
    data_and_context = parallel_state.get_data_parallel_group(with_context_parallel=True)
    torch.distributed.all_reduce(total, group=data_and_context)
    torch.distributed.all_reduce(tokens, group=data_and_context)
    # every stage that reads the loss mask (each that holds memory layers does) counted the same tokens
    torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.MAX,
                                 group=parallel_state.get_pipeline_model_parallel_group())
    return float(total) / max(float(tokens), 1.0)


def mean_lm_loss(losses: list) -> float:
    """Average of the microbatch LM losses, over data-parallel ranks, known on every rank."""
    value = torch.zeros(2, device=current_device())
    if losses:
        value[0] = torch.stack([entry["lm loss"] for entry in losses]).float().sum()
        value[1] = len(losses)
    torch.distributed.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return float(value[0] / value[1].clamp_min(1))


def microbatch_feed(model_chunks: list, batches: list) -> MicrobatchLookups:
    """The schedule's data iterator: the feed both engines share (`fe_megatron.tables.lookahead.
    microbatch_feed`: lookups one microbatch ahead where the batches carry ``host_tokens``, which
    `fe_megatron.training.run.EngineRun.fetches_rows_ahead` decides)."""
    model = _unwrap(model_chunks[0])
    return lookahead.microbatch_feed(
        batches, lambda tokens, positions: model.start_memory_lookups(tokens, current_device(), positions))


def run_microbatches(model_chunks: list, batches: list, seq_length: int, micro_batch_size: int,
                     forward_only: bool) -> list:
    # Megatron's schedules divide each microbatch's LM loss by their count and scale it by CP: so must the aux loss.
    SparsityLossAutoScaler.set_loss_scale(parallel_state.get_context_parallel_world_size() / len(batches))
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=microbatch_feed(model_chunks, batches), model=model_chunks,
        num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
        decoder_seq_length=seq_length, forward_only=forward_only)


def train_step(model_chunks: list, optimizer, batches: list, seq_length: int, micro_batch_size: int,
               check_finite: bool = False) -> StepResult:
    """Forward and backward over ``batches`` (the microbatches of one global batch on this DP rank),
    then one optimizer step.  With ``check_finite`` the loss and the gradient norm are checked
    first, and no update is applied when either is not finite (``StepResult.nonfinite`` says
    which rank's microbatch went wrong).  Either way the gradients are prepared and their norm
    computed once: the step clips by that norm (`compat.step_with_grad_norm`) instead of letting
    Megatron's ``optimizer.step()`` take a second pass over every gradient."""
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = run_microbatches(model_chunks, batches, seq_length, micro_batch_size, forward_only=False)
    lm = mean_lm_loss(losses)
    sparsity = pop_sparsity_loss(model_chunks, len(batches))
    if optimizer.prepare_grads():  # a loss scaler found inf or nan (fp16): Megatron skips the step
        return StepResult(lm, sparsity, math.nan, False, ["the loss scaler found inf or nan in the gradients"])
    grad_norm = float(optimizer.get_grad_norm())
    if check_finite and not (math.isfinite(lm) and math.isfinite(grad_norm)):
        return StepResult(lm, sparsity, grad_norm, False, _locate_nonfinite(losses, lm, grad_norm))
    updated = compat.step_with_grad_norm(optimizer, grad_norm)
    return StepResult(lm, sparsity, grad_norm, updated)


def _locate_nonfinite(losses: list, lm: float, grad_norm: float) -> list:
    """Every rank's microbatches whose loss is not finite (a collective: call it on every rank)."""
    mine = [nonfinite_microbatch(index, float(entry["lm loss"]))
            for index, entry in enumerate(losses) if not math.isfinite(float(entry["lm loss"]))]
    return nonfinite_report(mine, lm, grad_norm)


@torch.no_grad()
def eval_step(model_chunks: list, batches: list, seq_length: int, micro_batch_size: int) -> float:
    """Mean LM loss over ``batches`` without updating anything."""
    for chunk in model_chunks:
        chunk.eval()
    try:
        losses = run_microbatches(model_chunks, batches, seq_length, micro_batch_size, forward_only=True)
        pop_sparsity_loss(model_chunks, len(batches))
    finally:
        for chunk in model_chunks:
            chunk.train()
    return mean_lm_loss(losses)
