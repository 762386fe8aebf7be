"""``fe-pretrain``: pretrain a FactorEngram, Engram or plain Transformer GPT with megatron.core.

See `DESCRIPTION` (the ``--help`` text) and docs/training.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

from fe_megatron import ops
from fe_megatron.third_party_warnings import silence_known_third_party_warnings
from fe_megatron.training_loop import (NONFINITE_EXIT_CODE, REQUEUE_EXIT_CODE, EngineRun, MetricsWriter,
                                       NonFiniteError, clear_requeue_marker, freeze_backbone, guard_resume,
                                       load_run_tokenizer, log, run_datasets, run_info, train)

DESCRIPTION = """\
Pretrain a FactorEngram, Engram or plain Transformer GPT with megatron.core (or, with
training.engine=deepspeed, the Hugging Face model under DeepSpeed ZeRO), in one process or
under torchrun / srun / the deepspeed launcher.

examples:
  fe-pretrain --config examples/configs/demo_cpu.yaml --save runs/demo_run
  fe-pretrain --config examples/configs/demo_cpu.yaml memory=null training.train_steps=100
  torchrun --nproc_per_node 8 -m fe_megatron.train \\
      --config examples/configs/paper_340m_factorengram.yaml --save checkpoints/run1

Every training.log_interval steps it prints and records (TensorBoard and SAVE/metrics.jsonl)
the LM loss, the sparsity loss (lambda x Eq. 12), the learning rate, the gradient norm,
tokens/s, memory and the time left; every training.eval_interval the validation perplexity;
every training.save_interval a distributed checkpoint. --load DIR resumes from DIR's latest
checkpoint. The config's sections and fields: docs/training.md.
"""


def transformer_config_for(cfg, on_gpu: bool):
    """Megatron's TransformerConfig for the run: the backbone from ``cfg.model``, the layout from
    ``cfg.parallel``, precision and recompute from ``cfg.training``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p, t = cfg.model, cfg.parallel, cfg.training
    bf16 = t.precision == "bf16" or (t.precision == "auto" and on_gpu)
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if t.recompute == "full" else {}
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps, init_method_std=m.init_std, add_bias_linear=False,
        bias_activation_fusion=False, hidden_dropout=m.dropout, attention_dropout=m.dropout,
        masked_softmax_fusion=on_gpu,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=not on_gpu, tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline, sequence_parallel=p.sequence_parallel, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32, **recompute)


def count_parameters(model) -> int:
    """Parameters of the whole model: summed over TP shards and pipeline stages (tied weights once),
    and row-sharded tables over the memory-parallel (expert-parallel) group too."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from fe_megatron.megatron.step import current_device

    local = torch.zeros(2, dtype=torch.float64, device=current_device())  # [whole on this stage, row-sharded]
    for name, param in model.named_parameters():
        if name.endswith("output_layer.weight") and getattr(model, "share_embeddings_and_output_weights", False):
            continue  # the last stage's copy of the tied embedding
        if param_is_not_tensor_parallel_duplicate(param):
            local[1 if getattr(param, "row_sharded", False) else 0] += param.numel()
    torch.distributed.all_reduce(local[1:], group=parallel_state.get_expert_model_parallel_group())
    torch.distributed.all_reduce(local, group=parallel_state.get_model_parallel_group())
    return int(local.sum())


@dataclasses.dataclass
class TrainingRun(EngineRun):
    """Everything a run holds once it is set up: the model and its optimizer, the data, the
    step to start from, and where metrics go."""

    cfg: object
    info: dict  # the run info saved with every checkpoint (`run_info`)
    model: object  # this pipeline stage's FactorEngramGPTModel (or GPTModel)
    ddp: object  # the model in Megatron's DistributedDataParallel
    optimizer: object
    scheduler: object
    datasets: tuple  # train, validation, test
    num_microbatches: int  # per data-parallel rank and step
    attention_mask: torch.Tensor
    metrics: "MetricsWriter"
    start_step: int
    parameters: int

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


def check_kernel_backend(name: str, device: torch.device) -> None:
    """A forced kernel backend must be built and take tensors of the run's device: the tables'
    gathers, their (row-exchanged) gradients and the hash all run on it."""
    backend = ops.get_backend(name)
    if device.type not in backend.devices:
        raise ValueError(f"kernel backend {name!r} runs on {'/'.join(backend.devices)} tensors, but this run's "
                         f"tables are on {device.type}; use kernel_backend=auto or one of "
                         f"{[n for n in ops.available_backends() if device.type in ops.get_backend(n).devices]}")


def pretrain(cfg) -> dict:
    """Run (or resume) the configured pretraining; returns the final metrics."""
    from fe_megatron.config import ConfigError

    t = cfg.training
    if t.kernel_backend != "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            check_kernel_backend(t.kernel_backend, device)
        except ValueError as err:
            raise ConfigError("kernel_backend", f"{err} (docs/kernels.md)", section="training") from None
    ops.set_deterministic_backward(t.deterministic_table_grads)
    if t.engine == "deepspeed":
        from fe_megatron.deepspeed.engine import set_up as set_up_engine
    else:
        set_up_engine = set_up
    with contextlib.nullcontext() if t.kernel_backend == "auto" else ops.use_backend(t.kernel_backend):
        run = set_up_engine(cfg)
        try:
            return train(run)
        finally:
            run.metrics.close()


def choose_checkpoint(cfg, info: dict):
    """``(folder, its run info)`` of the verified checkpoint ``--load`` resumes from (``(None, None)``:
    start from step 0), after the resume guards (`fe_megatron.resume_guard`) compared its config
    with this run's."""
    from fe_megatron.checkpoint_files import read_run_info
    from fe_megatron.megatron.checkpointing import find_checkpoint, holds_weights_only

    if not cfg.load:
        return None, None
    folder = find_checkpoint(cfg.load, cfg.training.on_corrupt_checkpoint, log)
    if folder is None:
        log(f"no checkpoint in {cfg.load} yet: starting from step 0")
        return None, None
    saved = read_run_info(folder)
    guard_resume(folder, saved, info, weights_only=holds_weights_only(folder))
    return folder, saved


def set_up(cfg) -> TrainingRun:
    """Process groups, data, model, optimizer and schedule; resume from ``cfg.load`` if it has a checkpoint."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.checkpointing import holds_weights_only, load_checkpoint
    from fe_megatron.megatron.parallel import initialize
    from fe_megatron.megatron.step import causal_mask, current_device

    m, t, o, p = cfg.model, cfg.training, cfg.optimizer, cfg.parallel
    initialize(p.tensor, p.pipeline, seed=t.seed, table_sharding=p.table_sharding)
    on_gpu = torch.cuda.is_available()
    log(f"kernels: {ops.current_backend(current_device())} (built: {', '.join(ops.available_backends())}); "
        f"table gradients {'deterministic' if t.deterministic_table_grads else 'atomic'}")
    tokenizer = load_run_tokenizer(cfg)
    dp = parallel_state.get_data_parallel_world_size()
    info = run_info(cfg, dp)
    resume_from, saved_info = choose_checkpoint(cfg, info)
    datasets = run_datasets(cfg, tokenizer, dp)

    tconfig = transformer_config_for(cfg, on_gpu)
    model = build_gpt_model(tconfig, m.vocab_size, m.seq_length, cfg.memory, backend=t.transformer_impl,
                            share_embeddings=m.tie_embeddings, rotary_base=m.rope_base,
                            table_sharding=p.table_sharding, prefetch_table_rows=p.prefetch_table_rows)
    if on_gpu:
        model.cuda()
    if t.freeze_backbone:
        freeze_backbone(model)
    ddp = wrap_ddp(model, tconfig, use_distributed_optimizer=p.distributed_optimizer)
    optimizer = build_optimizer([ddp], OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.beta1,
        adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad, bf16=tconfig.bf16,
        params_dtype=tconfig.params_dtype, use_distributed_optimizer=p.distributed_optimizer),
        table_lr_mult=o.table_lr_mult, table_weight_decay_mult=o.table_weight_decay_mult)
    connect_schedule_hooks(tconfig, [ddp], optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=t.train_steps, lr_decay_style="cosine", start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=t.train_steps, wd_incr_style="constant")
    start = 0
    if resume_from is not None:
        same_layout = (saved_info or {}).get("layout") == info["layout"]
        start = load_checkpoint(resume_from, [ddp], optimizer, scheduler, p.distributed_optimizer,
                                restore_rng=same_layout)
        if holds_weights_only(resume_from):
            log(f"loaded the weights of {resume_from} (a converted checkpoint: no optimizer state); training "
                "starts at step 0")
        else:
            log(f"resumed from {resume_from} at iteration {start}; random states "
                f"{'restored' if same_layout else 'not restored (the parallel layout changed)'}")

    run = TrainingRun(cfg=cfg, info=info, model=model, ddp=ddp, optimizer=optimizer, scheduler=scheduler,
                      datasets=datasets,
                      num_microbatches=t.global_batch_size // (t.micro_batch_size * dp),
                      attention_mask=causal_mask(m.seq_length, current_device()),
                      metrics=MetricsWriter(cfg.save, cfg.tensorboard_dir), start_step=start,
                      parameters=count_parameters(model))
    clear_requeue_marker(cfg.save)
    run.metrics.write({"event": "start", "kind": cfg.model_kind, "parameters": run.parameters, "start_step": start,
                       "world_size": torch.distributed.get_world_size(), "dp": dp, "tp": p.tensor, "pp": p.pipeline})
    log(f"model {cfg.model_kind}: {run.parameters:,} parameters; TP={p.tensor} PP={p.pipeline} DP={dp}; "
        f"{run.num_microbatches} microbatches of {t.micro_batch_size} x {m.seq_length} tokens per rank and step")
    return run


def main(argv=None) -> int:
    silence_known_third_party_warnings()
    parser = argparse.ArgumentParser(prog="fe-pretrain", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="YAML training config, e.g. examples/configs/demo_cpu.yaml (docs/training.md)")
    parser.add_argument("--load", help="resume from the latest checkpoint in this directory")
    parser.add_argument("--save", help="checkpoint and metrics directory")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.train_steps=100")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = parser.parse_args(argv)
    from fe_megatron.config import ConfigError
    from fe_megatron.data.sources import DataError
    from fe_megatron.train_config import load_train_config

    overrides = list(args.overrides)
    if args.load:
        overrides.append(f"load={args.load}")
    if args.save:
        overrides.append(f"save={args.save}")
    try:
        cfg = load_train_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as err:  # ConfigError, invalid YAML, a missing file
        print(f"fe-pretrain: error: {err}", file=sys.stderr)
        return 2
    from fe_megatron.checkpoint_files import CheckpointError

    try:
        result = pretrain(cfg)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as err:
        print(f"fe-pretrain: error: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:
        print(f"fe-pretrain: error: {err}", file=sys.stderr)
        return NONFINITE_EXIT_CODE
    finally:
        if torch.distributed.is_initialized():
            if cfg.training.engine == "deepspeed":
                torch.distributed.destroy_process_group()
            else:
                from fe_megatron.megatron.parallel import shutdown

                shutdown()
    if result.get("event") == "preempted":
        # Under torchrun a non-zero exit would make the agent restart the workers here; the launch
        # script reads the marker file that the run wrote instead (launch_scripts/slurm/pretrain.sbatch).
        return 0 if "TORCHELASTIC_RESTART_COUNT" in os.environ else REQUEUE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
