"""The bundled CPU demo: FactorEngram against the same-size Transformer on the State of the Union corpus."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "sotu.jsonl.gz")
CONFIG = os.path.join(ROOT, "examples", "configs", "demo_cpu.yaml")
KINDS = ("factorengram", "transformer")
# The throughput both models are compared by: after training, in one process, this many training
# steps of each model, alternating (factorengram, transformer, factorengram, ...), after
# PAIRED_WARMUP_STEPS of each, so that both are timed under the same load (`paired_throughput`).
PAIRED_STEPS = 40
PAIRED_WARMUP_STEPS = 3
THROUGHPUT_FILE = "throughput.json"
DESCRIPTION = """\
Pretrain a small FactorEngram model and the same-size Transformer on the bundled corpus, on CPU:

1. train a 4096-piece sentencepiece tokenizer on the bundled corpus (data/sotu.jsonl.gz);
2. preprocess it into a Megatron indexed dataset (90/5/5 train/validation/test split);
3. train a tiny FactorEngram model and the plain Transformer with the same backbone on the
   same tokens (examples/configs/demo_cpu.yaml, one fe-pretrain process each);
4. time both models' training steps in one process, alternating one step of each, so that
   their throughput is measured under the same load (--out/throughput.json);
5. print both models' held-out perplexity, parameters and throughput side by side, and write
   loss_curves.png and TensorBoard logs under --out.
"""


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def read_metrics(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def plot(out_dir, metrics):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for kind, rows in metrics.items():
        train = [(r["step"], r["lm_loss"]) for r in rows if "lm_loss" in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        line, = ax.plot(*zip(*train), label=f"{kind} train")
        ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{kind} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("LM loss (nats/token)")
    ax.set_title("FactorEngram vs Transformer, same backbone and tokens (CPU demo)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "loss_curves.png")
    fig.savefig(path, dpi=120)
    return path


def repository_files() -> None:
    """The demo reads the repository's corpus and config, not files inside the installed package:
    say so, and what to do, when this installation has no repository beside it."""
    missing = [path for path in (CORPUS, CONFIG) if not os.path.isfile(path)]
    if missing:
        raise SystemExit(f"fe-demo: error: {missing[0]} is missing. fe-demo runs from a clone of the fe_megatron "
                         "repository (it reads data/sotu.jsonl.gz and examples/configs/demo_cpu.yaml there); this "
                         "installation has none beside it. Clone the repository and run `make demo` in it.")


def config_steps() -> tuple:
    """(training steps, warm-up steps) of the demo config."""
    import yaml

    with open(CONFIG) as fh:
        config = yaml.safe_load(fh)
    return config["training"]["train_steps"], config["optimizer"]["warmup_steps"]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of steps")
    return value


def time_alternating_steps(runs: dict, steps: int, warmup_steps: int, clock=time.perf_counter) -> dict:
    """Time ``steps`` training steps of each run in ``runs`` (``{kind: EngineRun}``, two of them),
    alternating one step of each in the dict's order, after ``warmup_steps`` of each taken the same
    way and not timed.  A step is what the training loop times: reading its batches, the step, the
    schedule's advance.

    Returns the record `paired_throughput` writes: per kind the step times, the tokens/s of its
    median step and the mean tokens/s (tokens over the summed step times), the ratio of the first
    kind's median tokens/s to the second's, and the machine's load average before and after.
    Medians, because on a busy machine a step either runs at full speed or waits seconds for a core,
    and which steps wait is chance: of 40 pairs at a load average of 7 on 2 cores, the means gave a
    ratio of 0.53, the medians 0.69 (0.80 in a quiet moment)."""
    kinds = list(runs)
    first, second = kinds
    seconds = {kind: [] for kind in kinds}
    load_before = os.getloadavg()[0]
    for step in range(warmup_steps + steps):
        for kind in kinds:
            run = runs[kind]
            t = run.cfg.training
            start = clock()
            batches = run.batches(run.datasets[0], step * t.global_batch_size, run.num_microbatches)
            run.train_step(batches)
            run.advance_schedule()
            if step >= warmup_steps:
                seconds[kind].append(clock() - start)
    tokens_per_step = {kind: runs[kind].cfg.training.global_batch_size * runs[kind].cfg.model.seq_length
                       for kind in kinds}
    tokens_per_s = {kind: tokens_per_step[kind] / statistics.median(seconds[kind]) for kind in kinds}
    return {"method": "paired", "order": f"alternating: {first}, {second}, {first}, ...",
            "steps_per_model": steps, "warmup_steps_per_model": warmup_steps, "tokens_per_step": tokens_per_step,
            "step_seconds": seconds, "tokens_per_s": tokens_per_s,
            "mean_tokens_per_s": {kind: tokens_per_step[kind] * steps / sum(seconds[kind]) for kind in kinds},
            "ratio": tokens_per_s[first] / tokens_per_s[second], "ratio_of": f"{first} / {second}",
            "statistics": "tokens_per_s and ratio: of each model's median step; mean_tokens_per_s: over all its "
                          "timed steps",
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}, "cpus": os.cpu_count()}


def paired_throughput(configs: dict, steps: int, warmup_steps: int) -> dict:
    """Set up each config's run (``{kind: TrainConfig}``, without --save: nothing is written) in this
    process and time their steps alternately (`time_alternating_steps`): one step of each in turn,
    so that both meet the same load and their ratio is a fair comparison at it.  Two fe-pretrain
    processes one after the other met different loads (the ratio of their means was 0.48 to 0.90 for
    the same pair).  The ratio still depends on how busy the machine is (README.md gives measurements).

    Megatron's model-parallel state is one per process: it is set up again for each run (with one
    process, the same groups of one rank), and the process group is shut down at the end."""
    from fe_megatron.training.third_party_warnings import silence_known_third_party_warnings

    silence_known_third_party_warnings()  # before Megatron is imported: it warns as it loads
    from megatron.core import parallel_state

    from fe_megatron.train import engine_module

    runs, engine = {}, None
    try:
        for kind, cfg in configs.items():
            engine = engine_module(cfg.training.engine)
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            runs[kind] = engine.set_up(cfg)
        return time_alternating_steps(runs, steps, warmup_steps)
    finally:
        for run in runs.values():
            run.metrics.close()
        if engine is not None:
            engine.shut_down()


def measure_throughput(out: str, overrides: dict, steps: int, metrics: dict) -> dict:
    """`paired_throughput` of the demo's two configs (their training overrides, no --save), written
    to ``out``/throughput.json with the training runs' own mean tokens/s beside it."""
    from fe_megatron.training.config import load_train_config

    print(f"+ throughput: {steps} training steps of each model, alternating one step of each in this process "
          f"(after {PAIRED_WARMUP_STEPS} untimed)", flush=True)
    configs = {kind: load_train_config(CONFIG, overrides[kind]) for kind in KINDS}
    throughput = paired_throughput(configs, steps, PAIRED_WARMUP_STEPS)
    throughput["training_run_tokens_per_s"] = {
        kind: next(r for r in reversed(rows) if r.get("event") == "final")["tokens_per_s"]
        for kind, rows in metrics.items()}
    with open(os.path.join(out, THROUGHPUT_FILE), "w") as fh:
        json.dump(throughput, fh, indent=1)
    return throughput


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fe-demo", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    repository_files()
    config_train_steps, config_warmup = config_steps()
    parser.add_argument("--steps", type=positive_int, default=None,
                        help=f"training steps per model (default {config_train_steps}); warm-up scales with them")
    parser.add_argument("--paired-steps", type=positive_int, default=PAIRED_STEPS,
                        help=f"steps of each model in the throughput measurement after training, alternating one "
                             f"step of each (default {PAIRED_STEPS}, after {PAIRED_WARMUP_STEPS} untimed)")
    args = parser.parse_args(argv)
    start = time.time()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    py = sys.executable
    tokenizer = os.path.join(out, "tokenizer.model")
    prefix = os.path.join(out, "data", "sotu")
    if not os.path.isfile(tokenizer):
        run([py, "-m", "fe_megatron.data.cli", "train-tokenizer", "--input", CORPUS,
             "--output-prefix", tokenizer[:-len(".model")], "--vocab-size", "4096"])
    if not os.path.isfile(prefix + ".idx"):
        run([py, "-m", "fe_megatron.data.cli", "preprocess", "--input", CORPUS,
             "--tokenizer-model", tokenizer, "--output-prefix", prefix, "--no-progress"])
    metrics, overrides = {}, {}
    for kind in KINDS:
        run_dir, tensorboard_dir = os.path.join(out, kind), os.path.join(out, "tensorboard", kind)
        for folder in (run_dir, tensorboard_dir):  # a rerun starts clean: no stacked curves
            shutil.rmtree(folder, ignore_errors=True)
        overrides[kind] = [*(["memory=null"] if kind == "transformer" else []), f"data.tokenizer_model={tokenizer}",
                           f"data.train_data=[{prefix}]", f"data.cache_dir={os.path.join(out, 'cache')}"]
        if args.steps:
            warmup = config_warmup * args.steps // config_train_steps  # the same fraction of the run as in the config
            overrides[kind] += [f"training.train_steps={args.steps}", f"optimizer.warmup_steps={warmup}"]
        run([py, "-m", "fe_megatron.train", "--config", CONFIG, *overrides[kind], f"save={run_dir}",
             f"tensorboard_dir={tensorboard_dir}"])
        metrics[kind] = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    throughput = measure_throughput(out, overrides, args.paired_steps, metrics)
    finals = {kind: next(r for r in reversed(rows) if r.get("event") == "final") for kind, rows in metrics.items()}
    vals = {kind: [r for r in rows if "val_ppl" in r][-1] for kind, rows in metrics.items()}
    png = plot(out, metrics)
    print()
    print(f"{'model':<14}{'val ppl':>10}{'test ppl':>10}{'parameters':>14}{'tokens/s':>11}")
    for kind in KINDS:
        f, v = finals[kind], vals[kind]
        print(f"{kind:<14}{v['val_ppl']:>10.2f}{f['test_ppl']:>10.2f}{f['parameters']:>14,}"
              f"{throughput['tokens_per_s'][kind]:>11,.0f}")
    load = throughput["load_average_1min"]
    print(f"(tokens/s: the median step of {throughput['steps_per_model']} training steps of each model after "
          f"training, alternating one step of each in one process, so both ran under the same load; "
          f"{throughput['ratio_of']} = {throughput['ratio']:.2f}; load average {load['before']:.1f} before, "
          f"{load['after']:.1f} after, on {throughput['cpus']} cores. {THROUGHPUT_FILE} has every step's time; "
          f"the training runs' own means, one run after the other: "
          + ", ".join(f"{kind} {throughput['training_run_tokens_per_s'][kind]:,.0f}" for kind in KINDS) + ")")
    tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    tensorboard = tensorboard if os.path.isfile(tensorboard) else "tensorboard"
    print(f"\nloss curves: {png}\nTensorBoard: {tensorboard} --logdir {os.path.join(out, 'tensorboard')}")
    print(f"demo finished in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
