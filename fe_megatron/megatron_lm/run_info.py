"""The run info (``fe_run.json``) of a Megatron-LM trainer run: its command line in fe-pretrain's
configuration terms, so that ``fe-convert mcore-to-hf`` converts its checkpoints."""

from __future__ import annotations

import dataclasses
import os

from fe_megatron.training.config import DataArgs, OptimizerArgs, ParallelArgs, TrainConfig, TrainingArgs
from fe_megatron.megatron_lm.arguments import backbone_from_megatron_args


def hf_conversion_problems(args) -> list:
    """What in the backbone the Hugging Face model (RoPE, RMSNorm, SwiGLU, no biases) cannot hold."""
    checks = {
        "--swiglu": args.swiglu, "--normalization RMSNorm": args.normalization == "RMSNorm",
        "--disable-bias-linear": not args.add_bias_linear, "--position-embedding-type rope":
            args.position_embedding_type == "rope", "--rotary-percent 1.0": args.rotary_percent == 1.0,
        "no --num-experts": not args.num_experts, "no --qk-layernorm": not args.qk_layernorm,
        "no --multi-latent-attention": not args.multi_latent_attention,
        "no --use-rope-scaling": not args.use_rope_scaling,
    }
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern:
        from fe_megatron.hybrid_pattern import is_gpt_shaped

        checks["a --hybrid-layer-pattern of '*-' pairs (the Llama layer)"] = is_gpt_shaped(pattern.split("/")[0])
    return [flag for flag, holds in checks.items() if not holds]


def train_config_of(args, memory) -> TrainConfig:
    """fe-pretrain's configuration for what the Megatron-LM arguments ``args`` train."""
    # --moe-aux-loss-coeff takes one value per load-balancing type: the run info keeps the first
    coeff = args.moe_aux_loss_coeff
    coeff = coeff[0] if isinstance(coeff, (list, tuple)) else coeff
    experts = dict(num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_aux_loss_coeff=float(coeff)) if args.num_experts else {}
    return TrainConfig(
        model=dataclasses.replace(backbone_from_megatron_args(args), **experts), memory=memory,
        parallel=ParallelArgs(tensor=args.tensor_model_parallel_size, pipeline=args.pipeline_model_parallel_size,
                              sequence_parallel=args.sequence_parallel,
                              distributed_optimizer=args.use_distributed_optimizer,
                              table_sharding=args.fe_table_sharding, expert=args.expert_model_parallel_size,
                              shared_table_folder=getattr(args, "fe_shared_table_folder", ParallelArgs.shared_table_folder)),
        optimizer=OptimizerArgs(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                beta1=args.adam_beta1, beta2=args.adam_beta2, eps=args.adam_eps,
                                clip_grad=args.clip_grad, warmup_steps=args.lr_warmup_iters,
                                table_lr_mult=args.fe_table_lr_mult,
                                table_weight_decay_mult=args.fe_table_weight_decay_mult,
                                table_state_dtype=args.fe_table_state_dtype, table_update=args.fe_table_update),
        training=TrainingArgs(train_steps=args.train_iters, micro_batch_size=args.micro_batch_size,
                              global_batch_size=args.global_batch_size, seed=args.seed,
                              precision="bf16" if args.bf16 else "fp32",
                              transformer_impl="te" if args.transformer_impl == "transformer_engine" else "local",
                              log_interval=args.log_interval, eval_interval=args.eval_interval,
                              eval_steps=args.eval_iters),
        data=DataArgs(tokenizer_model=args.tokenizer_model or "", train_data=list(args.data_path or []),
                      split=args.split or "98,1,1"),
        save=args.save, load=args.load, tensorboard_dir=args.tensorboard_dir)


def run_info_of(args, config: TrainConfig, plan=None, world_size: int = None) -> dict:
    """``fe_run.json`` for a checkpoint of this run (``config``: `train_config_of`; see
    `fe_megatron.checkpoint.run_info.run_info`), plus the trainer that wrote it, how its tables were
    trained (``plan``'s mode, as fe-pretrain records it) and, where the backbone has no Hugging Face
    form, why."""
    from fe_megatron.checkpoint.run_info import run_info

    info = run_info(config, args.data_parallel_size, world_size=world_size)
    info["trainer"] = "megatron-lm"
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern:  # a HybridModel's checkpoint: its tensors are named by the pattern's layers
        info["hybrid_layer_pattern"] = pattern
    if plan is not None:
        info["tables"] = plan.mode
    problems = hf_conversion_problems(args)
    if problems:
        info["not_convertible"] = ("the Hugging Face model is RoPE, RMSNorm, SwiGLU without biases; this run "
                                   f"would need {', '.join(problems)}")
    return info


def run_info_from_checkpoint_arguments(folder: str) -> dict:
    """The run info of Megatron-LM checkpoint ``folder`` written without one (by Megatron-LM's own
    ``pretrain_gpt.py``, patched to build the memory, or by this trainer before it sealed checkpoints):
    rebuilt from the arguments Megatron-LM stores in every checkpoint (``args`` of its common state,
    the ``--fe-*`` ones included; none of them: the stock GPT model). Raises ValueError naming what is
    missing and the tool that does work."""
    import argparse

    from megatron.core import dist_checkpointing

    from fe_megatron.megatron_lm.arguments import add_factorengram_arguments, memory_config_from_args

    try:
        common = dist_checkpointing.load_common_state_dict(folder)
    except Exception as error:  # not a torch_dist checkpoint, or not Megatron-LM's
        raise ValueError(f"{folder} has no fe_run.json and megatron-core cannot read its common state ({error}): "
                         "it is not a Megatron-LM checkpoint in the torch_dist format; resume it with "
                         "fe_megatron.megatron_lm.pretrain_gpt --load (--ckpt-format torch_dist), whose next save "
                         "records the run info") from None
    args = common.get("args") if isinstance(common, dict) else None
    if args is None:
        raise ValueError(f"{folder} has no fe_run.json and its common state holds no Megatron-LM arguments; resume "
                         "it with fe_megatron.megatron_lm.pretrain_gpt --load, whose next save records the run info")
    defaults = add_factorengram_arguments(argparse.ArgumentParser()).parse_args([])
    for name, value in vars(defaults).items():  # a checkpoint of the stock script has no --fe-* arguments
        if not hasattr(args, name):
            setattr(args, name, value)
    if args.fe_memory_config is not None and not os.path.isfile(args.fe_memory_config):
        raise ValueError(f"{folder} was trained with --fe-memory-config {args.fe_memory_config}, which is not here; "
                         "the memory's shape is in that file: put it back at that path to convert")
    if not args.tokenizer_model or not os.path.exists(args.tokenizer_model):
        raise ValueError(f"{folder} was trained with --tokenizer-model {args.tokenizer_model}, which is not here; "
                         "put the run's tokenizer at that path to convert (its vocabulary is the model's)")
    memory = memory_config_from_args(args)
    info = run_info_of(args, train_config_of(args, memory), world_size=args.world_size)
    info["run_info_from"] = "the checkpoint's Megatron-LM arguments"
    return info
