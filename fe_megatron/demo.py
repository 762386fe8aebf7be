"""The bundled CPU demo: FactorEngram against the same-size Transformer on the State of the Union corpus."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "sotu.jsonl.gz")
CONFIG = os.path.join(ROOT, "examples", "configs", "demo_cpu.yaml")
KINDS = ("factorengram", "transformer")
DESCRIPTION = """\
Pretrain a small FactorEngram model and the same-size Transformer on the bundled corpus, on CPU:

1. train a 4096-piece sentencepiece tokenizer on the bundled corpus (data/sotu.jsonl.gz);
2. preprocess it into a Megatron indexed dataset (90/5/5 train/validation/test split);
3. train a tiny FactorEngram model and the plain Transformer with the same backbone on the
   same tokens (examples/configs/demo_cpu.yaml, one fe-pretrain process each);
4. print both models' held-out perplexity, parameters and throughput side by side, and write
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fe-demo", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    repository_files()
    config_train_steps, config_warmup = config_steps()
    parser.add_argument("--steps", type=positive_int, default=None,
                        help=f"training steps per model (default {config_train_steps}); warm-up scales with them")
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
    metrics = {}
    for kind in KINDS:
        run_dir, tensorboard_dir = os.path.join(out, kind), os.path.join(out, "tensorboard", kind)
        for folder in (run_dir, tensorboard_dir):  # a rerun starts clean: no stacked curves
            shutil.rmtree(folder, ignore_errors=True)
        cmd = [py, "-m", "fe_megatron.train", "--config", CONFIG, *(["memory=null"] if kind == "transformer" else []),
               f"data.tokenizer_model={tokenizer}", f"data.train_data=[{prefix}]", f"save={run_dir}",
               f"tensorboard_dir={tensorboard_dir}", f"data.cache_dir={os.path.join(out, 'cache')}"]
        if args.steps:
            warmup = config_warmup * args.steps // config_train_steps  # the same fraction of the run as in the config
            cmd += [f"training.train_steps={args.steps}", f"optimizer.warmup_steps={warmup}"]
        run(cmd)
        metrics[kind] = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    finals = {kind: next(r for r in reversed(rows) if r.get("event") == "final") for kind, rows in metrics.items()}
    vals = {kind: [r for r in rows if "val_ppl" in r][-1] for kind, rows in metrics.items()}
    png = plot(out, metrics)
    print()
    print(f"{'model':<14}{'val ppl':>10}{'test ppl':>10}{'parameters':>14}{'tokens/s':>11}")
    for kind in KINDS:
        f, v = finals[kind], vals[kind]
        print(f"{kind:<14}{v['val_ppl']:>10.2f}{f['test_ppl']:>10.2f}{f['parameters']:>14,}{f['tokens_per_s']:>11,.0f}")
    print("(tokens/s: the mean over the run's training steps, without the first logging window)")
    tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    tensorboard = tensorboard if os.path.isfile(tensorboard) else "tensorboard"
    print(f"\nloss curves: {png}\nTensorBoard: {tensorboard} --logdir {os.path.join(out, 'tensorboard')}")
    print(f"demo finished in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
