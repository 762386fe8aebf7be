"""fe-pretrain's Megatron-Core engine (``training.engine: megatron``, the default): the GPT model
of `fe_megatron.megatron.builder` at any TP/PP/SP/CP/DP layout, Megatron's distributed
optimizer and schedule, and distributed checkpoints (`fe_megatron.megatron.checkpointing`).

`set_up` builds a `MegatronRun` (an `fe_megatron.training.run.EngineRun`) that
`fe_megatron.training.loop.train` drives, the same way as the DeepSpeed engine's
(`fe_megatron.deepspeed.engine`).

What the run changes in megatron-core and torch (the CPU backend on a host without CUDA, the tables'
gradients into ``main_grad``) is installed when `set_up` starts the Megatron world
(`fe_megatron.megatron.parallel.initialize`) and undone by `shut_down`, which fe-pretrain calls when the
run ends, also after an error (`fe_megatron.megatron.patches`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from fe_megatron import ops
from fe_megatron.checkpoint.commit import find_checkpoint
from fe_megatron.checkpoint.resume import start_run
from fe_megatron.training.distributed import current_device, log
from fe_megatron.training.loop import MetricsWriter
from fe_megatron.training.run import (EngineRun, begin, freeze_backbone, microbatches_per_rank, table_plan,
                                      use_bf16)


def transformer_config_for(cfg, on_gpu: bool):
    """Megatron's TransformerConfig for the run: the backbone from ``cfg.model``, the layout from
    ``cfg.parallel``, precision and recompute from ``cfg.training``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fe_megatron.megatron import compat

    from fe_megatron.hybrid_pattern import layers_of

    m, p, t = cfg.model, cfg.parallel, cfg.training
    bf16 = use_bf16(t, on_gpu)
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if t.recompute == "full" else {}
    # an MoE FFN: Megatron's all-to-all token dispatcher needs CUDA streams, its all-gather one runs on gloo
    experts = dict(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                   moe_aux_loss_coeff=m.moe_aux_loss_coeff, expert_model_parallel_size=p.expert,
                   moe_token_dispatcher_type="alltoall" if on_gpu else "allgather") if m.num_experts else {}
    # a hybrid backbone has one layer per symbol of its pattern (num_layers counts its attention layers)
    num_layers = len(layers_of(m.hybrid_layer_pattern)) if m.hybrid_layer_pattern else m.num_layers
    return TransformerConfig(
        num_layers=num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps, init_method_std=m.init_std, add_bias_linear=False,
        bias_activation_fusion=False, hidden_dropout=m.dropout, attention_dropout=m.dropout,
        masked_softmax_fusion=on_gpu and compat.fused_softmax_available(),
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=not on_gpu, tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline, sequence_parallel=p.sequence_parallel, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32, **recompute, **experts)


def count_parameters(model) -> int:
    """Parameters of the whole model: summed over TP shards and pipeline stages (tied weights once),
    and row-sharded tables over their row group too; experts once per expert-parallel rank."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from fe_megatron.megatron.parallel import table_row_group
    from fe_megatron.memory.branch import memory_branches

    # [whole on this stage, row-sharded, an expert's]
    local = torch.zeros(3, dtype=torch.float64, device=current_device())
    for name, param in model.named_parameters():
        if name.endswith("output_layer.weight") and getattr(model, "share_embeddings_and_output_weights", False):
            continue  # the last stage's copy of the tied embedding
        if param_is_not_tensor_parallel_duplicate(param):
            expert = not getattr(param, "allreduce", True) and not getattr(param, "is_memory_table", False)
            local[1 if getattr(param, "row_sharded", False) else 2 if expert else 0] += param.numel()
    for branch in memory_branches(model).values():  # tables in stores are no parameters (table_optimizer.py)
        outside = sum(tensor.numel() for tensor in branch.tables.holder.outside_module.values())
        local[0 if branch.row_partition is None else 1] += outside
    torch.distributed.all_reduce(local[1:2], group=table_row_group())
    torch.distributed.all_reduce(local[2:], group=parallel_state.get_expert_model_parallel_group())
    torch.distributed.all_reduce(local, group=parallel_state.get_model_parallel_group())
    return int(local.sum())


@dataclasses.dataclass
class MegatronRun(EngineRun):
    """A Megatron run, set up and possibly resumed: the model and its optimizer, the data, the
    step to start from, and where metrics go; the `EngineRun` of this engine."""

    model: object  # this pipeline stage's FactorEngramGPTModel (or GPTModel)
    ddp: object  # the model in Megatron's DistributedDataParallel
    optimizer: object
    scheduler: object
    attention_mask: torch.Tensor

    def data_parallel_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    def batch_attention_mask(self) -> torch.Tensor:
        return self.attention_mask  # megatron's default mask would be built on CUDA

    def train_step(self, batches: list):
        from fe_megatron.megatron.step import train_step

        return train_step([self.ddp], self.optimizer, batches, self.cfg.model.seq_length,
                          self.cfg.training.micro_batch_size, check_finite=True)

    def advance_schedule(self) -> None:
        self.scheduler.step(increment=1)

    def learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def evaluate(self, dataset, index: int) -> float:
        """Mean LM loss over ``eval_steps`` global batches of ``dataset``, the ``index``-th such window."""
        from fe_megatron.megatron.step import eval_step

        t = self.cfg.training
        batches = self.evaluation_batches(dataset, index)
        return eval_step([self.ddp], batches, self.cfg.model.seq_length, t.micro_batch_size)

    def save(self, step: int) -> None:
        from fe_megatron.megatron.checkpointing import save_checkpoint

        cfg = self.cfg
        path = save_checkpoint(cfg.save, [self.ddp], self.optimizer, self.scheduler, step,
                               cfg.parallel.distributed_optimizer, run_info=self.info,
                               keep=cfg.training.keep_checkpoints)
        log(f"saved {path}")


def find_megatron_checkpoint(cfg):
    """``find(directory)`` for `fe_megatron.checkpoint.resume.start_point`: the verified checkpoint
    folder per ``training.on_corrupt_checkpoint``."""
    return lambda directory: find_checkpoint(directory, cfg.training.on_corrupt_checkpoint, log)


def set_up(cfg) -> MegatronRun:
    """Process groups, data, model, optimizer and schedule; resume from ``cfg.load`` if it has a checkpoint."""
    from megatron.core import parallel_state

    from fe_megatron.megatron import compat
    from fe_megatron.megatron.builder import wrap_ddp
    from fe_megatron.megatron.checkpointing import holds_weights_only, load_checkpoint
    from fe_megatron.megatron.parallel import initialize
    from fe_megatron.megatron.step import causal_mask
    from fe_megatron.megatron.table_optimizer import refuse_table_optimizer_change
    from fe_megatron.memory.sharding import stages_without_memory

    m, t, p = cfg.model, cfg.training, cfg.parallel
    initialize(p.tensor, p.pipeline, seed=t.seed, expert_parallel_size=p.expert,
               timeout_minutes=p.distributed_timeout_minutes)
    unsupported = compat.unsupported_version_message()
    if unsupported:
        log(f"warning: {unsupported}")
    on_gpu = torch.cuda.is_available()
    log(f"kernels: {ops.current_backend(current_device())} (built: {', '.join(ops.available_backends())}); "
        f"table gradients {'deterministic' if t.deterministic_table_grads else 'atomic'}")
    dp = parallel_state.get_data_parallel_world_size()
    plan = table_plan(cfg, use_bf16(t, on_gpu), bool(cfg.memory and stages_without_memory(
        cfg.memory.layers, m.num_layers, p.pipeline, m.hybrid_layer_pattern)))
    start = start_run(cfg, "megatron", dp, plan, {"expert": p.expert} if p.expert > 1 else None,
                      find_checkpoint=find_megatron_checkpoint(cfg),
                      refuse_table_change=refuse_table_optimizer_change, holds_weights_only=holds_weights_only)
    resume_from = start.start_at.folder if start.start_at.kind == "checkpoint" else None

    tconfig = transformer_config_for(cfg, on_gpu)
    model, tables = build_stage_model(cfg, tconfig, plan)
    ddp = wrap_ddp(model, tconfig, use_distributed_optimizer=p.distributed_optimizer)
    optimizer, scheduler = build_optimizer_and_schedule(cfg, ddp, tconfig, tables)
    step = 0
    if resume_from is not None:
        same_layout = (start.start_at.saved or {}).get("layout") == start.info["layout"]
        step = load_checkpoint(resume_from, [ddp], optimizer, scheduler, p.distributed_optimizer,
                               restore_rng=same_layout)
        if start.weights_only:
            log(f"loaded the weights of {resume_from} (a converted checkpoint: no optimizer state); training "
                "starts at step 0")
        else:
            log(f"resumed from {resume_from} at iteration {step}; random states "
                f"{'restored' if same_layout else 'not restored (the parallel layout changed)'}")

    run = MegatronRun(cfg=cfg, info=start.info, model=model, ddp=ddp, optimizer=optimizer, scheduler=scheduler,
                      datasets=start.datasets, num_microbatches=microbatches_per_rank(t, dp),
                      attention_mask=causal_mask(m.seq_length, current_device()),
                      metrics=MetricsWriter(cfg.save, cfg.tensorboard_dir, step), start_step=step,
                      parameters=count_parameters(model))
    begin(run, f"TP={p.tensor} PP={p.pipeline} DP={dp}" + (f" EP={p.expert}" if p.expert > 1 else "")
          + (f", {plan.describe()}" if plan is not None else ""),
          world_size=torch.distributed.get_world_size(), dp=dp, tp=p.tensor, pp=p.pipeline)
    return run


def build_stage_model(cfg, tconfig, plan):
    """This pipeline stage's model, on the device and in the run's precision, and its tables'
    stores when the plan keeps them there (`fe_megatron.megatron.table_optimizer`; None otherwise)."""
    from fe_megatron.megatron.builder import build_gpt_model
    from fe_megatron.megatron.table_optimizer import manage_tables

    m, t, o, p = cfg.model, cfg.training, cfg.optimizer, cfg.parallel
    if m.hybrid_layer_pattern:
        from fe_megatron.megatron import compat
        from fe_megatron.megatron.builder import build_hybrid_model

        if not compat.has_hybrid_model():
            raise RuntimeError(f"model.hybrid_layer_pattern builds megatron-core's HybridModel, which megatron-core "
                               f"{compat.HYBRID_MINIMUM} and newer ship; megatron-core "
                               f"{compat.megatron_core_version()} is installed here (make setup-newest)")
        model = build_hybrid_model(tconfig, m.vocab_size, m.seq_length, m.hybrid_layer_pattern, cfg.memory,
                                   share_embeddings=m.tie_embeddings, rotary_base=m.rope_base,
                                   table_sharding=p.table_sharding)
    else:
        model = build_gpt_model(tconfig, m.vocab_size, m.seq_length, cfg.memory, backend=t.transformer_impl,
                                share_embeddings=m.tie_embeddings, rotary_base=m.rope_base,
                                table_sharding=p.table_sharding, prefetch_table_rows=p.prefetch_table_rows)
    tables = None
    if plan is not None and plan.in_stores:  # before .cuda(): host tables never reach the GPU
        tables = manage_tables(model, o, plan, current_device(), t.seed)
    if tconfig.bf16:
        # every parameter in bf16, as Megatron-LM's Float16Module makes them (its mixed-precision optimizer keeps
        # the fp32 copies and cannot checkpoint fp32 parameters beside bf16 ones); tables in stores keep their dtype
        model.to(torch.bfloat16)
    if torch.cuda.is_available():
        model.cuda()
    if t.freeze_backbone:
        freeze_backbone(model)
    return model, tables


def build_optimizer_and_schedule(cfg, ddp, tconfig, tables) -> tuple:
    """Megatron's optimizer chain, the tables' stores a member of it, and its learning-rate and
    weight-decay schedule (`fe_megatron.training.lr_schedule` computes the same for DeepSpeed)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from fe_megatron.megatron.builder import build_optimizer, connect_schedule_hooks

    t, o, p = cfg.training, cfg.optimizer, cfg.parallel
    optimizer = build_optimizer([ddp], OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.beta1,
        adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad, bf16=tconfig.bf16,
        params_dtype=tconfig.params_dtype, use_distributed_optimizer=p.distributed_optimizer),
        table_lr_mult=o.table_lr_mult, table_weight_decay_mult=o.table_weight_decay_mult, tables=tables)
    connect_schedule_hooks(tconfig, [ddp], optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=t.train_steps, lr_decay_style="cosine", start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=t.train_steps, wd_incr_style="constant",
        # training.schedule_on_resume=config: a checkpoint restores the step count, not the schedule
        override_opt_param_scheduler=t.schedule_on_resume == "config",
        use_checkpoint_opt_param_scheduler=t.schedule_on_resume == "checkpoint")
    return optimizer, scheduler


def shut_down() -> None:
    """Megatron's model-parallel state, the process group, and the run's patches."""
    from fe_megatron.megatron.parallel import shutdown

    shutdown()
