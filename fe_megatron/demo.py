"""The bundled CPU demo: FactorEngram against the same-size Transformer on the State of the Union corpus.

    python -m fe_megatron.demo [--out runs/demo] [--steps 300]

1. trains a 4096-piece sentencepiece tokenizer on the bundled corpus (``data/sotu.jsonl.gz``);
2. preprocesses the corpus into a Megatron indexed dataset (90/5/5 train/valid/test split);
3. trains a tiny FactorEngram model and the plain Transformer with the same backbone on the
   same tokens (``examples/configs/demo_cpu.yaml``, one process each via ``fe-pretrain``);
4. prints both models' held-out perplexity, parameters and throughput side by side and writes
   ``loss_curves.png`` and TensorBoard logs under ``--out``.
"""

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fe-demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--steps", type=int, default=None, help="training steps per model (config: 300)")
    args = parser.parse_args(argv)
    start = time.time()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    py = sys.executable
    tokenizer = os.path.join(out, "tokenizer.model")
    prefix = os.path.join(out, "data", "sotu")
    if not os.path.isfile(tokenizer):
        run([py, "-W", "ignore", "-m", "fe_megatron.data.cli", "train-tokenizer", "--input", CORPUS,
             "--output-prefix", tokenizer[:-len(".model")], "--vocab-size", "4096"])
    if not os.path.isfile(prefix + ".idx"):
        run([py, "-W", "ignore", "-m", "fe_megatron.data.cli", "preprocess", "--input", CORPUS,
             "--tokenizer-model", tokenizer, "--output-prefix", prefix, "--no-progress"])
    metrics = {}
    for kind in KINDS:
        run_dir = os.path.join(out, kind)
        if os.path.isdir(run_dir):
            shutil.rmtree(run_dir)
        cmd = [py, "-W", "ignore", "-m", "fe_megatron.train", "--config", CONFIG,
               *(["memory=null"] if kind == "transformer" else []), f"data.tokenizer_model={tokenizer}", f"data.train_data=[{prefix}]", f"save={run_dir}",
               f"tensorboard_dir={os.path.join(out, 'tensorboard', kind)}", f"data.cache_dir={os.path.join(out, 'cache')}"]
        if args.steps:
            cmd.append(f"training.train_steps={args.steps}")
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
    print(f"\nloss curves: {png}\nTensorBoard: tensorboard --logdir {os.path.join(out, 'tensorboard')}")
    print(f"demo finished in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
