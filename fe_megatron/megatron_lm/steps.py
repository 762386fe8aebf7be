"""The callbacks ``megatron.training.pretrain`` runs: the forward step with its loss, the datasets,
and the embedding ranks; Megatron-LM's ``pretrain_gpt.py`` ones (0.19) for the plain pretraining path,
with what the memory branch needs."""

from __future__ import annotations

from functools import partial
from typing import List

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import get_attr_wrapped_model, get_model_config
from megatron.training import get_args, get_timers, print_rank_0
from megatron.training.utils import get_blend_and_blend_per_split

from fe_megatron.megatron.batch import forward_microbatch
from fe_megatron.megatron.sparsity import SparsityLossAutoScaler, microbatch_gradient_scale
from fe_megatron.megatron_lm.batch import get_batch, stage_reads_data
from fe_megatron.training.distributed import current_device
from fe_megatron.training.losses import masked_sum


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's GPT loss: the masked sum, the token count, and ``lm loss`` for the log; a NaN
    or Inf loss is fatal when ``--check-for-nan-in-loss-and-grad`` is on."""
    args = get_args()
    loss, tokens = masked_sum(output_tensor, loss_mask)
    num_tokens = tokens.clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        rerun_state_machine = get_rerun_state_machine()
        for check, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(result=loss, rejection_func=check, tolerance=0.0, fatal=True,
                                                message=f"found {what} in local forward loss calculation")
    return loss, num_tokens, report


def sparsity_scale(model, loss_tokens=None) -> float:
    """The gradient this microbatch's sparsity term receives (`microbatch_gradient_scale`): as Megatron's
    schedules scale the mean LM loss, ``cp_size / num_microbatches``, or with ``--calculate-per-token-loss``
    the microbatch's loss-mask tokens on this rank (``loss_tokens``); times the fp16 loss scale where there
    is one."""
    config = get_model_config(model)
    loss_scale = 1.0
    if config.grad_scale_func is not None:
        loss_scale = float(config.grad_scale_func(torch.ones(1, device=current_device())))
    per_token = bool(config.calculate_per_token_loss)
    if per_token and loss_tokens is None:
        raise RuntimeError("--calculate-per-token-loss: this pipeline stage holds memory layers but read no loss "
                           "mask to count the microbatch's tokens by")
    return microbatch_gradient_scale(get_num_microbatches(), mpu.get_context_parallel_world_size(), per_token,
                                     float(loss_tokens) if per_token else 0.0, loss_scale)


def forward_step(data_iterator, model, return_schedule_plan: bool = False, *, state):
    """One microbatch forward. With memory layers the sparsity term's gradient scale is set first
    (`sparsity_scale`; see `fe_megatron.megatron.sparsity`)."""
    if return_schedule_plan:
        raise ValueError("--overlap-moe-expert-parallel-comm builds a schedule plan, which fe_megatron.megatron_lm "
                         "does not provide; train without it")
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    hasher = get_attr_wrapped_model(model, "hasher") if state.memory is not None else None
    batch = get_batch(data_iterator, vp_stage, hasher)
    timers("batch-generator").stop()
    if state.memory is not None:
        scale = sparsity_scale(model, batch.loss_tokens)  # refuses per-token loss without a loss mask, by name
        # under per-token loss a microbatch's term is logged by its tokens, as its gradient is scaled by them
        per_token = bool(get_model_config(model).calculate_per_token_loss)
        log_weight = float(batch.loss_tokens) if per_token else 1.0
        SparsityLossAutoScaler.set_loss_scale(scale, log_weight)
        if per_token and model.training:
            state.step_loss_tokens += log_weight
    output_tensor = forward_microbatch(model, batch)
    if state.memory is not None and not model.training:
        get_attr_wrapped_model(model, "pop_sparsity_loss")()  # evaluation's terms stay out of the training log
    return output_tensor, partial(loss_func, batch.loss_mask)


def core_gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    """Megatron-LM's GPT dataset configuration from its arguments (pretrain_gpt.py, 0.19)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens, fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap, context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel)


def train_valid_test_datasets(train_val_test_num_samples, vp_stage=None, *, state):
    """The datasets, built on the ranks that read data: TP rank 0 of the first and last pipeline
    stages, and of every stage that holds a memory layer."""
    args = get_args()
    holds_memory = state.memory is not None and state.stage_holds_memory()

    def is_built_on_rank():
        return mpu.get_tensor_model_parallel_rank() == 0 and stage_reads_data(vp_stage, holds_memory)

    print_rank_0("> building train, validation, and test datasets for GPT ...")
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    datasets = BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, is_built_on_rank,
                                             core_gpt_dataset_config_from_args(args)).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


def get_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """The first stage's rank, and the last stage's when the output layer shares the embedding."""
    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return sorted(set(ranks))
