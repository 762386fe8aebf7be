"""A training script of a team's own, in the shape of Megatron-LM's pretrain_gpt.py (megatron-core 0.19):
its own batch, loss and forward step around megatron.training.pretrain.
tests/integration/test_megatron_lm_recipes.py applies the change docs/megatron_lm.md documents ("A training script of your own") and trains with it."""

from functools import partial

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import get_batch_on_this_tp_rank
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split


def get_batch(data_iterator):
    args = get_args()
    batch = {}
    if mpu.get_tensor_model_parallel_rank() == 0:
        sample = next(data_iterator)
        batch = {key: sample[key] for key in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
                 if sample.get(key) is not None}
    batch = get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader, cp_size=1,
        tp_rank=mpu.get_tensor_model_parallel_rank(), micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=False, pipeline_model_parallel_size=1,
        is_pipeline_first_stage=True, is_pipeline_last_stage=True)
    return batch


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan=False):
    batch = get_batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
                              blend_per_split=blend_per_split, split=args.split, tokenizer=build_tokenizer(args),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=args.create_attention_mask_in_dataloader,
                              path_to_cache=args.data_cache_path, mid_level_dataset_surplus=0.005)
    return BlendedMegatronDatasetBuilder(GPTDataset, train_val_test_num_samples,
                                         lambda: mpu.get_tensor_model_parallel_rank() == 0, config).build()


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    model_config = gpt_config_from_args(args)
    pretrain(pretrain_cfg_container_from_args(args, model_config), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step)
