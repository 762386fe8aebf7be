"""``fe-pretrain``: pretrain a FactorEngram, Engram or plain Transformer GPT with megatron.core.

See `DESCRIPTION` (the ``--help`` text) and docs/training.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

from fe_megatron import ops
from fe_megatron.third_party_warnings import silence_known_third_party_warnings

DESCRIPTION = """\
Pretrain a FactorEngram, Engram or plain Transformer GPT with megatron.core, in one process
or under torchrun / srun.

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


def freeze_backbone(model) -> None:
    """``training.freeze_backbone``: train the memory branches only (after a graft onto a pretrained
    model); every other weight keeps its value and gets no gradient or optimizer state."""
    trainable = 0
    for name, param in model.named_parameters():
        param.requires_grad = ".memory." in name
        trainable += param.numel() if param.requires_grad else 0
    if not trainable:
        raise ValueError("training.freeze_backbone=true but the model has no memory branch to train "
                         "(memory: null); set freeze_backbone=false")


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


def _memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 20
    import psutil

    return psutil.Process().memory_info().rss / 2 ** 20


class MetricsWriter:
    """JSON lines in ``<save>/metrics.jsonl`` and TensorBoard scalars, written by global rank 0."""

    def __init__(self, save_dir, tensorboard_dir):
        self.enabled = torch.distributed.get_rank() == 0
        self.file = self.tb = None
        if not self.enabled:
            return
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
            self.file = open(os.path.join(save_dir, "metrics.jsonl"), "a")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict):
        if not self.enabled:
            return
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb and "step" in record:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])
            self.tb.flush()

    def close(self):
        if self.tb:
            self.tb.close()
        if self.file:
            self.file.close()


def log(message: str):
    if torch.distributed.get_rank() == 0:
        print(message, flush=True)


@dataclasses.dataclass
class TrainingRun:
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

    @property
    def samples_per_rank(self) -> int:
        return self.num_microbatches * self.cfg.training.micro_batch_size

    def batches(self, dataset, first_sample: int, num_microbatches: int) -> list:
        """``num_microbatches`` microbatches of this data-parallel rank, from global sample ``first_sample``."""
        from megatron.core import parallel_state

        from fe_megatron.data.datasets import microbatches
        from fe_megatron.megatron.step import current_device

        t = self.cfg.training
        start = first_sample + parallel_state.get_data_parallel_rank() * self.samples_per_rank
        batches = microbatches(dataset, start, num_microbatches, t.micro_batch_size, self.attention_mask)
        if torch.cuda.is_available():
            batches = [{k: v.to(current_device()) for k, v in b.items()} for b in batches]
        return batches


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
    with contextlib.nullcontext() if t.kernel_backend == "auto" else ops.use_backend(t.kernel_backend):
        run = set_up(cfg)
        try:
            return train(run)
        finally:
            run.metrics.close()


def run_info(cfg, data_parallel_size: int) -> dict:
    """What every checkpoint records about the run that wrote it (``fe_run.json``): the resolved
    config, the tokenizer and its checksum, and the parallel layout."""
    import torch.distributed as dist

    from fe_megatron import __version__
    from fe_megatron.checkpoint_files import file_digest
    from fe_megatron.data.tokenizer import tokenizer_file

    p = cfg.parallel
    return {"config": dataclasses.asdict(cfg), "fe_megatron": __version__,
            "tokenizer": {"path": os.path.abspath(cfg.data.tokenizer_model),
                          "sha256": file_digest(tokenizer_file(cfg.data.tokenizer_model))["sha256"]},
            "layout": {"world": dist.get_world_size(), "tensor": p.tensor, "pipeline": p.pipeline,
                       "data": data_parallel_size, "table_sharding": p.table_sharding}}


def choose_checkpoint(cfg, info: dict):
    """``(folder, its run info)`` of the verified checkpoint ``--load`` resumes from (``(None, None)``:
    start from step 0), after the resume guards (`fe_megatron.resume_guard`) compared its config
    with this run's."""
    from fe_megatron import resume_guard
    from fe_megatron.checkpoint_files import CheckpointError, read_run_info
    from fe_megatron.megatron.checkpointing import find_checkpoint

    if not cfg.load:
        return None, None
    folder = find_checkpoint(cfg.load, cfg.training.on_corrupt_checkpoint, log)
    if folder is None:
        log(f"no checkpoint in {cfg.load} yet: starting from step 0")
        return None, None
    saved = read_run_info(folder)
    refused, changed = resume_guard.compare(saved, info)
    if refused:
        raise CheckpointError(f"cannot resume from {folder}; these settings differ from the checkpoint's:\n  "
                              + "\n  ".join(refused) + "\nRestore them, or start a new run in another --save "
                              "directory without --load.")
    for line in changed:
        log(f"changed since the checkpoint: {line}")
    return folder, saved


def set_up(cfg) -> TrainingRun:
    """Process groups, data, model, optimizer and schedule; resume from ``cfg.load`` if it has a checkpoint."""
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from fe_megatron.data.datasets import build_datasets
    from fe_megatron.data.sources import DataError
    from fe_megatron.data.tokenizer import load_tokenizer
    from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
    from fe_megatron.megatron.checkpointing import holds_weights_only, load_checkpoint
    from fe_megatron.megatron.parallel import initialize
    from fe_megatron.megatron.step import causal_mask, current_device

    m, t, o, p = cfg.model, cfg.training, cfg.optimizer, cfg.parallel
    initialize(p.tensor, p.pipeline, seed=t.seed, table_sharding=p.table_sharding)
    on_gpu = torch.cuda.is_available()
    log(f"kernels: {ops.current_backend(current_device())} (built: {', '.join(ops.available_backends())}); "
        f"table gradients {'deterministic' if t.deterministic_table_grads else 'atomic'}")
    tokenizer = load_tokenizer(cfg.data.tokenizer_model)
    if tokenizer.vocab_size > m.vocab_size:
        raise DataError(f"data.tokenizer_model {cfg.data.tokenizer_model} has {tokenizer.vocab_size} tokens but "
                        f"model.vocab_size={m.vocab_size}; the embedding must cover the tokenizer "
                        f"(set model.vocab_size >= {tokenizer.vocab_size})")
    dp = parallel_state.get_data_parallel_world_size()
    info = run_info(cfg, dp)
    resume_from, saved_info = choose_checkpoint(cfg, info)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ValueError(f"training.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x "
                         f"data-parallel size = {t.micro_batch_size} x {dp}")
    evals = t.train_steps // max(t.eval_interval, 1) + 2
    sizes = [t.train_steps * t.global_batch_size, evals * t.eval_steps * t.global_batch_size,
             t.eval_steps * t.global_batch_size]
    datasets = build_datasets(cfg.data.train_data, tokenizer, m.seq_length, cfg.data.split, sizes, t.seed,
                              cfg.data.cache_dir)

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
    if cfg.save and torch.distributed.get_rank() == 0 and os.path.exists(os.path.join(cfg.save, REQUEUE_MARKER)):
        os.remove(os.path.join(cfg.save, REQUEUE_MARKER))  # an earlier stop's request, answered by this start
    run.metrics.write({"event": "start", "kind": cfg.model_kind, "parameters": run.parameters, "start_step": start,
                       "world_size": torch.distributed.get_world_size(), "dp": dp, "tp": p.tensor, "pp": p.pipeline})
    log(f"model {cfg.model_kind}: {run.parameters:,} parameters; TP={p.tensor} PP={p.pipeline} DP={dp}; "
        f"{run.num_microbatches} microbatches of {t.micro_batch_size} x {m.seq_length} tokens per rank and step")
    return run


def evaluate(run: TrainingRun, dataset, index: int) -> float:
    """Mean LM loss over ``eval_steps`` global batches of ``dataset``, the ``index``-th such window."""
    from fe_megatron.megatron.step import eval_step

    t = run.cfg.training
    batches = run.batches(dataset, index * t.global_batch_size * t.eval_steps, run.num_microbatches * t.eval_steps)
    return eval_step([run.ddp], batches, run.cfg.model.seq_length, t.micro_batch_size)


REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: saved on SIGUSR1/SIGTERM; launch_scripts/slurm requeues the job
NONFINITE_EXIT_CODE = 3
REQUEUE_MARKER = "requeue_requested"


class NonFiniteError(RuntimeError):
    """A loss or gradient norm that is not finite, under ``training.on_nonfinite: halt``."""


class StopRequests:
    """SIGUSR1 (SLURM's warning before preemption or the time limit) and SIGTERM set a flag; after
    each step all ranks agree (one all-reduce) and stop together, at the same step."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self):
        self.received = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def agreed(self) -> bool:
        from fe_megatron.megatron.step import current_device

        flag = torch.tensor([1 if self.received else 0], dtype=torch.int64, device=current_device())  # NCCL: on GPU
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def train(run: TrainingRun) -> dict:
    """The training loop from ``run.start_step``: log, evaluate and save at their intervals, and
    report the test perplexity at the end.

    Throughput is timed over training steps only (evaluation and saving excluded).  Log lines
    show the last window's tokens/s and an ETA from the run's mean step time so far; the final
    record holds the run's mean tokens/s without the first window (start-up and warm-up).
    A non-finite loss or gradient norm halts (nothing saved) or skips the update, per
    ``training.on_nonfinite``; SIGUSR1 or SIGTERM ends the run after the current step with a
    checkpoint (docs/operations.md)."""
    stop = StopRequests()
    try:
        return _train(run, stop)
    finally:
        stop.restore()


def _train(run: TrainingRun, stop: StopRequests) -> dict:
    from fe_megatron import faults
    from fe_megatron.megatron.step import train_step

    cfg, t = run.cfg, run.cfg.training
    train_ds, valid_ds, test_ds = run.datasets
    rank = torch.distributed.get_rank()
    last, skipped = {}, 0
    tokens_per_step = t.global_batch_size * cfg.model.seq_length
    window_start, window_steps = time.time(), 0
    loop_start = time.time()
    timed = {"steps": 0, "seconds": 0.0}  # every log window but the first
    for step in range(run.start_step, t.train_steps):
        done = step + 1
        batches = run.batches(train_ds, step * t.global_batch_size, run.num_microbatches)
        if faults.at("nan_loss", done, rank):
            batches[0]["loss_mask"] = batches[0]["loss_mask"] * float("nan")
        result = train_step([run.ddp], run.optimizer, batches, cfg.model.seq_length, t.micro_batch_size,
                            check_finite=True)
        if result.nonfinite:
            report = (f"non-finite loss or gradient norm at step {done} (lm loss {result.lm_loss}, grad norm "
                      f"{result.grad_norm}):\n  " + "\n  ".join(result.nonfinite))
            if t.on_nonfinite == "halt":
                raise NonFiniteError(f"{report}\nHalting without saving (training.on_nonfinite=halt); the "
                                     "last checkpoint is intact. training.on_nonfinite=skip drops such steps instead.")
            skipped += 1
            log(f"{report}\nskipped the update (training.on_nonfinite=skip; {skipped} step(s) skipped so far)")
            run.metrics.write({"step": done, "skipped_steps": skipped})
        run.scheduler.step(increment=1)
        window_steps += 1
        if done % t.log_interval == 0 or done == t.train_steps:
            elapsed = time.time() - window_start
            if last:
                timed["steps"] += window_steps
                timed["seconds"] += elapsed
            eta = (time.time() - loop_start) / (done - run.start_step) * (t.train_steps - done)
            last = {"step": done, "lm_loss": result.lm_loss, "sparsity_loss": result.sparsity_loss,
                    "lr": run.optimizer.param_groups[0]["lr"], "grad_norm": result.grad_norm,
                    "tokens_per_s": tokens_per_step * window_steps / max(elapsed, 1e-9), "memory_mb": _memory_mb(),
                    "eta_s": round(eta)}
            run.metrics.write(last)
            log(f"step {done:>6}/{t.train_steps} | lm loss {result.lm_loss:.4f} | "
                f"sparsity {result.sparsity_loss:.4f} | lr {last['lr']:.2e} | grad norm {last['grad_norm']:.3f} | "
                f"{last['tokens_per_s']:,.0f} tok/s | {last['memory_mb']:,.0f} MB | ETA {_duration(eta)}")
            window_start, window_steps = time.time(), 0
        if done % t.eval_interval == 0 or done == t.train_steps:
            val = evaluate(run, valid_ds, done // max(t.eval_interval, 1))
            if not math.isfinite(val):
                raise NonFiniteError(f"validation loss at step {done} is {val}; halting before any save, the last "
                                     "checkpoint is intact")
            run.metrics.write({"step": done, "val_loss": val, "val_ppl": math.exp(min(val, 50))})
            log(f"step {done:>6} | validation loss {val:.4f} | perplexity {math.exp(min(val, 50)):.2f}")
            window_start = time.time()
        stopping = stop.agreed()
        if cfg.save and (stopping or done % t.save_interval == 0 or done == t.train_steps):
            save(run, done)
            window_start = time.time()
        if stopping:
            log(f"{stop.received or 'a stop signal on another rank'}: stopped after step {done}"
                f"{' with a checkpoint' if cfg.save else ' (no --save: nothing saved)'}; rerun with --load to resume")
            if cfg.save and rank == 0:
                with open(os.path.join(cfg.save, REQUEUE_MARKER), "w") as fh:
                    fh.write(str(done))
            return {"event": "preempted", "step": done}
        if t.exit_after and done >= t.exit_after:
            log(f"exiting after step {done} (training.exit_after)")
            return {"event": "exit", "step": done}
    test = evaluate(run, test_ds, 0)
    mean_tokens_per_s = (tokens_per_step * timed["steps"] / timed["seconds"] if timed["steps"]
                         else last.get("tokens_per_s"))
    final = {"event": "final", "step": t.train_steps, "test_loss": test, "test_ppl": math.exp(min(test, 50)),
             "parameters": run.parameters, "tokens_per_s": mean_tokens_per_s, "skipped_steps": skipped}
    run.metrics.write(final)
    log(f"test loss {test:.4f} | perplexity {final['test_ppl']:.2f}")
    return final


def save(run: TrainingRun, step: int) -> None:
    from fe_megatron.megatron.checkpointing import save_checkpoint

    cfg = run.cfg
    path = save_checkpoint(cfg.save, [run.ddp], run.optimizer, run.scheduler, step, cfg.parallel.distributed_optimizer,
                           run_info=run.info, keep=cfg.training.keep_checkpoints)
    log(f"saved {path}")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def main(argv=None) -> int:
    silence_known_third_party_warnings()
    parser = argparse.ArgumentParser(prog="fe-pretrain", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="YAML training config, e.g. examples/configs/demo_cpu.yaml (docs/training.md)")
    parser.add_argument("--load", help="resume from the latest checkpoint in this directory")
    parser.add_argument("--save", help="checkpoint and metrics directory")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.train_steps=100")
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
        from fe_megatron.megatron.parallel import shutdown

        if torch.distributed.is_initialized():
            shutdown()
    if result.get("event") == "preempted":
        # Under torchrun a non-zero exit would make the agent restart the workers here; the launch
        # script reads the marker file that the run wrote instead (launch_scripts/slurm/pretrain.sbatch).
        return 0 if "TORCHELASTIC_RESTART_COUNT" in os.environ else REQUEUE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
