"""A microbatch for Megatron-LM's trainer, with the token ids where the memory layers need them.

Megatron-LM's ``get_batch`` gives the tokens to the first pipeline stage (labels and loss mask
to the last) and nothing to the stages between. A stage that holds a memory layer hashes the
token ids itself, so `get_batch` reads the whole batch there. Under context parallelism the
n-grams are hashed on the full sequence before the split (`hash_then_split_for_context_parallel`)
and travel as the microbatch's ``memory_inputs`` (their addresses). The microbatch is the one both Megatron
trainers run (`fe_megatron.megatron.batch`).
"""

from __future__ import annotations

from megatron.core import mpu
from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args
from megatron.training.utils import is_first_or_last_pipeline_stage

from fe_megatron.megatron.batch import Microbatch
from fe_megatron.megatron.hasher import hash_then_split_for_context_parallel
from fe_megatron.memory.inputs import MemoryInputs
from fe_megatron.training.distributed import current_device

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def stage_reads_data(vp_stage=None, holds_memory: bool = False) -> bool:
    """Whether this pipeline stage reads the data: the first and last stages, as in Megatron-LM,
    and every stage that holds a memory layer."""
    return holds_memory or is_first_or_last_pipeline_stage(vp_stage)


def get_batch(data_iterator, vp_stage=None, hasher=None) -> Microbatch:
    """This rank's share of the next microbatch. ``hasher`` is the model's `MicrobatchHasher` on a
    stage that holds memory layers (None elsewhere, and for the stock GPT model)."""
    args = get_args()
    if not stage_reads_data(vp_stage, hasher is not None):
        return Microbatch(None, None, None, None, None, None, None)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        device = current_device()
        batch = {key: sample[key].to(device, non_blocking=True) if sample.get(key) is not None else None
                 for key in BATCH_KEYS}
    whole = hasher is not None  # every tensor, as a one-stage pipeline reads them
    batch = get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size, tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=1 if whole else args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    memory_inputs = None
    cp_size = args.context_parallel_size
    if hasher is not None and cp_size > 1:
        memory_inputs = MemoryInputs(addresses=hash_then_split_for_context_parallel(
            hasher, batch["tokens"], cp_size, mpu.get_context_parallel_rank(), batch.get("position_ids")))
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    last = mpu.is_pipeline_last_stage()
    loss_tokens = batch["loss_mask"].sum() if hasher is not None else None  # per-token weighting of the sparsity
    return Microbatch(batch.get("tokens"), batch.get("labels") if last else None,
                      batch.get("loss_mask") if last else None, batch.get("attention_mask"),
                      batch.get("position_ids"), memory_inputs, loss_tokens)
