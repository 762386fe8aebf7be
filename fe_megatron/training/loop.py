"""The training loop both engines run (Megatron-Core and DeepSpeed): metrics, stop requests,
non-finite halts, evaluation and save intervals.

An engine's run object (`fe_megatron.megatron.engine.MegatronRun`,
`fe_megatron.deepspeed.engine.DeepSpeedRun`) is an `fe_megatron.training.run.EngineRun`;
`train` drives it.  Nothing here imports megatron or deepspeed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import torch

from fe_megatron.training.distributed import current_device, log
from fe_megatron.training.run import REQUEUE_MARKER, EngineRun

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: saved on SIGUSR1/SIGTERM; launch_scripts/slurm requeues the job
NONFINITE_EXIT_CODE = 3


def memory_mb() -> float:
    """Peak CUDA memory of this rank, or its resident host memory on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 20
    import psutil

    return psutil.Process().memory_info().rss / 2 ** 20


def keep_records_up_to(path: str, start_step: int) -> int:
    """Rewrite the metrics file ``path`` without what a run starting at ``start_step`` writes again:
    step records after ``start_step`` (written after the checkpoint it resumes from, or by a run
    that saved none) and start events at or after it.  Returns how many records were dropped."""
    if not os.path.isfile(path):
        return 0
    with open(path) as fh:
        lines = [line for line in fh if line.strip()]
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash mid-write
            continue
        if "step" in record and record["step"] > start_step:
            continue
        if record.get("event") == "start" and record.get("start_step", 0) >= start_step:
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        with open(path + ".tmp", "w") as fh:
            fh.writelines(kept)
        os.replace(path + ".tmp", path)
    return len(lines) - len(kept)


class MetricsWriter:
    """JSON lines in ``<save>/metrics.jsonl`` and TensorBoard scalars, written by global rank 0.

    A run that starts at ``start_step`` over an existing ``metrics.jsonl`` (a resume, or a restart
    of a run that saved nothing) first drops what it will write again (`keep_records_up_to`), and
    TensorBoard purges its events after ``start_step``: every step is recorded once."""

    def __init__(self, save_dir, tensorboard_dir, start_step: int = 0):
        self.enabled = torch.distributed.get_rank() == 0
        self.file = self.tb = None
        if not self.enabled:
            return
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, "metrics.jsonl")
            dropped = keep_records_up_to(path, start_step)
            if dropped:
                log(f"{path}: dropped {dropped} record(s) after step {start_step}, which this run writes again")
            self.file = open(path, "a")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tensorboard_dir, purge_step=start_step + 1)

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
    from fe_megatron.training import faults

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
            skipped = _nonfinite_step(run, result, done, skipped)
        run.advance_schedule()
        window_steps += 1
        if done % t.log_interval == 0 or done == t.train_steps:
            elapsed = time.time() - window_start
            if last:
                timed["steps"] += window_steps
                timed["seconds"] += elapsed
            last = _log_step(run, result, done, tokens_per_step * window_steps / max(elapsed, 1e-9), loop_start)
            window_start, window_steps = time.time(), 0
        if done % t.eval_interval == 0 or done == t.train_steps:
            _validate(run, valid_ds, done)
            window_start = time.time()
        stopping = stop.agreed()
        exiting = bool(t.exit_after) and done >= t.exit_after
        periodic = bool(t.save_interval) and done % t.save_interval == 0  # save_interval 0: at the end only
        if cfg.save and (stopping or exiting or periodic or done == t.train_steps):
            run.save(done)
            window_start = time.time()
        if stopping or exiting:
            return _end_early(run, stop, done, stopping, rank)
    mean_tokens_per_s = (tokens_per_step * timed["steps"] / timed["seconds"] if timed["steps"]
                         else last.get("tokens_per_s"))
    return _finish(run, test_ds, mean_tokens_per_s, skipped)


def _nonfinite_step(run: EngineRun, result, done: int, skipped: int) -> int:
    """A step with a non-finite loss or gradient norm: halt, or count it as skipped (training.on_nonfinite).
    Returns the steps skipped so far."""
    report = (f"non-finite loss or gradient norm at step {done} (lm loss {result.lm_loss}, grad norm "
              f"{result.grad_norm}):\n  " + "\n  ".join(result.nonfinite))
    if run.cfg.training.on_nonfinite == "halt":
        raise NonFiniteError(f"{report}\nHalting without saving (training.on_nonfinite=halt); the "
                             "last checkpoint is intact. training.on_nonfinite=skip drops such steps instead.")
    skipped += 1
    log(f"{report}\nskipped the update (training.on_nonfinite=skip; {skipped} step(s) skipped so far)")
    run.metrics.write({"step": done, "skipped_steps": skipped})
    return skipped


def _log_step(run: EngineRun, result, done: int, tokens_per_s: float, loop_start: float) -> dict:
    """Record and log step ``done``: losses, learning rate, gradient norm, the last window's tokens/s, memory
    and the ETA from the run's mean step time so far.  Returns the record."""
    t = run.cfg.training
    eta = (time.time() - loop_start) / (done - run.start_step) * (t.train_steps - done)
    last = {"step": done, "lm_loss": result.lm_loss, "sparsity_loss": result.sparsity_loss,
            "lr": run.learning_rate(), "grad_norm": result.grad_norm,
            "tokens_per_s": tokens_per_s, "memory_mb": memory_mb(), "eta_s": round(eta)}
    run.metrics.write(last)
    sparsity = f"sparsity {result.sparsity_loss:.4f} | " if run.cfg.memory is not None else ""
    log(f"step {done:>6}/{t.train_steps} | lm loss {result.lm_loss:.4f} | "
        f"{sparsity}lr {last['lr']:.2e} | grad norm {last['grad_norm']:.3f} | "
        f"{last['tokens_per_s']:,.0f} tok/s | {last['memory_mb']:,.0f} MB | ETA {_duration(eta)}")
    return last


def _validate(run: EngineRun, valid_ds, done: int) -> None:
    """Evaluate on the validation set after step ``done``, and halt on a non-finite loss before any save."""
    val = run.evaluate(valid_ds, done // max(run.cfg.training.eval_interval, 1))
    if not math.isfinite(val):
        raise NonFiniteError(f"validation loss at step {done} is {val}; halting before any save, the last "
                             "checkpoint is intact")
    run.metrics.write({"step": done, "val_loss": val, "val_ppl": math.exp(min(val, 50))})
    log(f"step {done:>6} | validation loss {val:.4f} | perplexity {math.exp(min(val, 50)):.2f}")


def _end_early(run: EngineRun, stop: StopRequests, done: int, stopping: bool, rank: int) -> dict:
    """End the run after step ``done``: on a stop request all ranks agreed on (rank 0 leaves the requeue
    marker when it saved), or at training.exit_after."""
    cfg = run.cfg
    if stopping:
        log(f"{stop.received or 'a stop signal on another rank'}: stopped after step {done}"
            f"{' with a checkpoint' if cfg.save else ' (no --save: nothing saved)'}; rerun with --load to resume")
        if cfg.save and rank == 0:
            with open(os.path.join(cfg.save, REQUEUE_MARKER), "w") as fh:
                fh.write(str(done))
        return {"event": "preempted", "step": done}
    log(f"exiting after step {done} (training.exit_after)"
        f"{' with a checkpoint; rerun with --load to resume' if cfg.save else ' (no --save: nothing saved)'}")
    return {"event": "exit", "step": done}


def _finish(run: EngineRun, test_ds, mean_tokens_per_s, skipped: int) -> dict:
    """Evaluate on the test set at the end of training, and write and return the final record."""
    test = run.evaluate(test_ds, 0)
    final = {"event": "final", "step": run.cfg.training.train_steps, "test_loss": test,
             "test_ppl": math.exp(min(test, 50)), "parameters": run.parameters, "tokens_per_s": mean_tokens_per_s,
             "skipped_steps": skipped}
    run.metrics.write(final)
    log(f"test loss {test:.4f} | perplexity {final['test_ppl']:.2f}")
    return final


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
