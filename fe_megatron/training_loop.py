"""The training loop both engines run (Megatron-Core and DeepSpeed), and what they share: run
info, metrics, stop requests, the data each rank reads.

An engine's run object (`fe_megatron.train.TrainingRun`, `fe_megatron.deepspeed.engine.DeepSpeedRun`)
is an `EngineRun`; `train` drives it.  Nothing here imports
megatron or deepspeed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
import torch

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: saved on SIGUSR1/SIGTERM; launch_scripts/slurm requeues the job
NONFINITE_EXIT_CODE = 3
REQUEUE_MARKER = "requeue_requested"


def current_device() -> torch.device:
    """The device this rank computes on: its CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def log(message: str):
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def memory_mb() -> float:
    """Peak CUDA memory of this rank, or its resident host memory on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 20
    import psutil

    return psutil.Process().memory_info().rss / 2 ** 20


@dataclasses.dataclass
class StepResult:
    """One optimizer step: the LM and sparsity losses (global means), the gradient norm, whether the
    update was applied, and, when the loss or the gradient norm was not finite, where."""

    lm_loss: float
    sparsity_loss: float
    grad_norm: float
    updated: bool
    nonfinite: list = dataclasses.field(default_factory=list)  # "rank R microbatch M: lm loss nan", ...

    def __iter__(self):  # lm, sparsity, grad_norm, updated = train_step(...)
        return iter((self.lm_loss, self.sparsity_loss, self.grad_norm, self.updated))


class EngineRun:
    """What `train` needs of an engine's run (set up, possibly resumed).  An engine's dataclass
    holds ``cfg``, ``datasets`` (train, validation, test), ``num_microbatches`` (per data-parallel
    rank and step), ``metrics``, ``start_step`` and ``parameters``, and implements the methods
    below that raise NotImplementedError; the data each rank reads is the same for every engine."""

    @property
    def samples_per_rank(self) -> int:
        return self.num_microbatches * self.cfg.training.micro_batch_size

    def data_parallel_rank(self) -> int:
        raise NotImplementedError

    def batch_attention_mask(self):
        """The attention mask every batch carries (None: the model makes its own causal mask)."""
        return None

    def batches(self, dataset, first_sample: int, num_microbatches: int) -> list:
        """``num_microbatches`` microbatches of this data-parallel rank, from global sample ``first_sample``."""
        from fe_megatron.data.datasets import microbatches

        t = self.cfg.training
        start = first_sample + self.data_parallel_rank() * self.samples_per_rank
        batches = microbatches(dataset, start, num_microbatches, t.micro_batch_size, self.batch_attention_mask())
        device = current_device()
        return [{k: v.to(device) for k, v in b.items() if v is not None} for b in batches]

    def evaluation_batches(self, dataset, index: int) -> list:
        """This rank's microbatches of the ``index``-th window of ``eval_steps`` global batches of ``dataset``."""
        t = self.cfg.training
        return self.batches(dataset, index * t.global_batch_size * t.eval_steps, self.num_microbatches * t.eval_steps)

    def train_step(self, batches: list) -> StepResult:
        raise NotImplementedError

    def advance_schedule(self) -> None:
        raise NotImplementedError

    def learning_rate(self) -> float:
        raise NotImplementedError

    def evaluate(self, dataset, index: int) -> float:
        raise NotImplementedError

    def save(self, step: int) -> None:
        raise NotImplementedError


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


def run_info(cfg, data_parallel_size: int, engine: dict = None) -> dict:
    """What every checkpoint records about the run that wrote it (``fe_run.json``): the resolved
    config, the tokenizer and its checksum, and the parallel layout (plus ``engine``'s own
    settings, e.g. the ZeRO stage)."""
    import torch.distributed as dist

    from fe_megatron import __version__
    from fe_megatron.checkpoint_files import file_digest
    from fe_megatron.data.tokenizer import tokenizer_file

    p = cfg.parallel
    layout = {"world": dist.get_world_size(), "tensor": p.tensor, "pipeline": p.pipeline,
              "data": data_parallel_size, "table_sharding": p.table_sharding}
    layout.update(engine or {})
    return {"config": dataclasses.asdict(cfg), "fe_megatron": __version__,
            "tokenizer": {"path": os.path.abspath(cfg.data.tokenizer_model),
                          "sha256": file_digest(tokenizer_file(cfg.data.tokenizer_model))["sha256"]},
            "layout": layout}


def guard_resume(folder: str, saved: dict, info: dict, weights_only: bool = False) -> None:
    """Refuse to resume from ``folder`` (run info ``saved``) when a guarded setting of this run
    (``info``) differs (`fe_megatron.resume_guard`); log the other changes."""
    from fe_megatron import resume_guard
    from fe_megatron.checkpoint_files import CheckpointError

    refused, changed = resume_guard.compare(saved, info, weights_only=weights_only)
    if refused:
        raise CheckpointError(f"cannot resume from {folder}; these settings differ from the checkpoint's:\n  "
                              + "\n  ".join(refused) + "\nRestore them, or start a new run in another --save "
                              "directory without --load.")
    for line in changed:
        log(f"changed since the checkpoint: {line}")


def load_run_tokenizer(cfg):
    """The run's tokenizer, refused when the embedding does not cover it."""
    from fe_megatron.data.sources import DataError
    from fe_megatron.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer_model)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(f"data.tokenizer_model {cfg.data.tokenizer_model} has {tokenizer.vocab_size} tokens but "
                        f"model.vocab_size={cfg.model.vocab_size}; the embedding must cover the tokenizer "
                        f"(set model.vocab_size >= {tokenizer.vocab_size})")
    return tokenizer


def run_datasets(cfg, tokenizer, data_parallel_size: int) -> tuple:
    """Train, validation and test datasets sized for the whole run (every engine reads the same
    samples: global batch ``i`` is samples ``[i B, (i + 1) B)``, split over data-parallel ranks in
    rank order)."""
    from fe_megatron.data.datasets import build_datasets

    t, m = cfg.training, cfg.model
    if t.global_batch_size % (t.micro_batch_size * data_parallel_size):
        raise ValueError(f"training.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size x "
                         f"data-parallel size = {t.micro_batch_size} x {data_parallel_size}")
    evals = t.train_steps // max(t.eval_interval, 1) + 2
    sizes = [t.train_steps * t.global_batch_size, evals * t.eval_steps * t.global_batch_size,
             t.eval_steps * t.global_batch_size]
    return build_datasets(cfg.data.train_data, tokenizer, m.seq_length, cfg.data.split, sizes, t.seed,
                          cfg.data.cache_dir)


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


def clear_requeue_marker(save_dir) -> None:
    """A start answers an earlier stop's requeue request: remove its marker."""
    if save_dir and torch.distributed.get_rank() == 0 and os.path.exists(os.path.join(save_dir, REQUEUE_MARKER)):
        os.remove(os.path.join(save_dir, REQUEUE_MARKER))


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
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int64, device=current_device())  # NCCL: on GPU
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def train(run: EngineRun) -> dict:
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


def _train(run: EngineRun, stop: StopRequests) -> dict:
    from fe_megatron import faults

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
        result = run.train_step(batches)
        if result.nonfinite:
            report = (f"non-finite loss or gradient norm at step {done} (lm loss {result.lm_loss}, grad norm "
                      f"{result.grad_norm}):\n  " + "\n  ".join(result.nonfinite))
            if t.on_nonfinite == "halt":
                raise NonFiniteError(f"{report}\nHalting without saving (training.on_nonfinite=halt); the "
                                     "last checkpoint is intact. training.on_nonfinite=skip drops such steps instead.")
            skipped += 1
            log(f"{report}\nskipped the update (training.on_nonfinite=skip; {skipped} step(s) skipped so far)")
            run.metrics.write({"step": done, "skipped_steps": skipped})
        run.advance_schedule()
        window_steps += 1
        if done % t.log_interval == 0 or done == t.train_steps:
            elapsed = time.time() - window_start
            if last:
                timed["steps"] += window_steps
                timed["seconds"] += elapsed
            eta = (time.time() - loop_start) / (done - run.start_step) * (t.train_steps - done)
            last = {"step": done, "lm_loss": result.lm_loss, "sparsity_loss": result.sparsity_loss,
                    "lr": run.learning_rate(), "grad_norm": result.grad_norm,
                    "tokens_per_s": tokens_per_step * window_steps / max(elapsed, 1e-9), "memory_mb": memory_mb(),
                    "eta_s": round(eta)}
            run.metrics.write(last)
            log(f"step {done:>6}/{t.train_steps} | lm loss {result.lm_loss:.4f} | "
                f"sparsity {result.sparsity_loss:.4f} | lr {last['lr']:.2e} | grad norm {last['grad_norm']:.3f} | "
                f"{last['tokens_per_s']:,.0f} tok/s | {last['memory_mb']:,.0f} MB | ETA {_duration(eta)}")
            window_start, window_steps = time.time(), 0
        if done % t.eval_interval == 0 or done == t.train_steps:
            val = run.evaluate(valid_ds, done // max(t.eval_interval, 1))
            if not math.isfinite(val):
                raise NonFiniteError(f"validation loss at step {done} is {val}; halting before any save, the last "
                                     "checkpoint is intact")
            run.metrics.write({"step": done, "val_loss": val, "val_ppl": math.exp(min(val, 50))})
            log(f"step {done:>6} | validation loss {val:.4f} | perplexity {math.exp(min(val, 50)):.2f}")
            window_start = time.time()
        stopping = stop.agreed()
        if cfg.save and (stopping or done % t.save_interval == 0 or done == t.train_steps):
            run.save(done)
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
    test = run.evaluate(test_ds, 0)
    mean_tokens_per_s = (tokens_per_step * timed["steps"] / timed["seconds"] if timed["steps"]
                         else last.get("tokens_per_s"))
    final = {"event": "final", "step": t.train_steps, "test_loss": test, "test_ppl": math.exp(min(test, 50)),
             "parameters": run.parameters, "tokens_per_s": mean_tokens_per_s, "skipped_steps": skipped}
    run.metrics.write(final)
    log(f"test loss {test:.4f} | perplexity {final['test_ppl']:.2f}")
    return final


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
