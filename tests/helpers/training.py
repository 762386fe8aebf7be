"""fe-pretrain as the tests run it: the demo config at a small size, a launch in a session of its
own (under torchrun for several processes), and what a run leaves behind (its metrics and curve)."""

import json
import os
import shutil
import sys

from tests.helpers.paths import CONFIG, ENDS_CLEANLY, ROOT  # noqa: F401 - re-exported for the tests
from tests.helpers.torchrun_util import clean_environment, failed_launch, run_in_own_session


def small_overrides(data, **extra):
    """The demo config at test size on ``data`` (the ``small_data`` fixture), plus ``extra``, as overrides."""
    values = {"data.tokenizer_model": data["tokenizer"], "data.train_data": f"[{data['prefix']}]",
              "model.vocab_size": 512, "memory.table_capacity": "[512, 4096, 4096]", "model.seq_length": 64,
              "training.train_steps": 8, "training.log_interval": 2, "training.eval_interval": 4,
              "training.eval_steps": 2, "training.save_interval": 4, "training.micro_batch_size": 2,
              "training.global_batch_size": 8, "optimizer.warmup_steps": 2}
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def pretrain_cmd(nproc=1, python=sys.executable, ends_cleanly=False):
    entry = [ENDS_CLEANLY] if ends_cleanly else ["-m", "fe_megatron.train"]
    if nproc == 1:
        return [python] + entry
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + entry


def run_pretrain(args, nproc=1, check=True, extra_env=None, python=sys.executable, ends_cleanly=False):
    """fe-pretrain with ``args`` (under torchrun for ``nproc`` > 1); ``ends_cleanly``: through
    tests/distributed/ends_cleanly.py, which also fails when process-group threads are left."""
    proc = run_in_own_session(pretrain_cmd(nproc, python, ends_cleanly) + args,
                              clean_environment(**(extra_env or {})))
    if check:
        assert proc.returncode == 0, failed_launch(proc)
    return proc


def metrics(save_dir):
    with open(os.path.join(save_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def metrics_if_any(save):
    """A run's metrics, or none where the run wrote none yet (or is writing its first line)."""
    try:
        return metrics(save)
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def curve(rows):
    return [(r["step"], r.get("lm_loss"), r.get("sparsity_loss"), r.get("val_loss"))
            for r in rows if "step" in r and "event" not in r]


def final_curve(save):
    """The run's logged values by step, the last record of each step winning (a resumed run logs
    the steps after its checkpoint again)."""
    by_step = {}
    for step, *values in curve(metrics(save)):
        by_step.setdefault(step, {}).update({i: v for i, v in enumerate(values) if v is not None})
    return by_step


def resume_at(source: str, step: int, target: str) -> str:
    """A run directory holding only ``source``'s checkpoint of ``step`` (as if the run stopped there)."""
    name = f"iter_{step:07d}"
    shutil.copytree(os.path.join(source, name), os.path.join(target, name))
    with open(os.path.join(target, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(step))
    return target
