"""The paper's comparisons as one command, at a size that fits the machine.

    python examples/reproduce/reproduce.py [--size cpu-tiny|gpu] [--out runs/reproduce] [--steps N]

Groups (every run shares the backbone, the data, the tokens and the schedule):
  main       Transformer, Engram and FactorEngram (Table 2), each with two seeds to measure noise
  components scalar gate, no unigram, Engram with unigram (Table 3)
  lambda     the sparsity weight 0, 1e-4, 1e-2 beside the main run's 1e-3 (Table 4)
  placement  before the FFN and inside it beside the main run's before-attention (Table 5)
  depth      single layers and a shallow/deep pair beside the main run's middle pair
  weight decay  the tables decayed like every weight (the paper's Table 8) beside the main run's
             Engram-style exemption

``cpu-tiny`` is the bundled demo's 4-layer d=128 backbone on the State of the Union corpus;
``gpu`` is a 12-layer d=768 backbone (~85M parameters without embeddings) with a 32K tokenizer,
for a machine with a GPU and a larger corpus (``--corpus``).  Finished runs are skipped, so an
interrupted reproduction resumes where it stopped.  Writes ``results.md`` (the layout of the
paper's Tables 2-5) and ``curves_<group>.png`` under ``--out``.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from fe_megatron.demo import CONFIG, CORPUS, read_metrics, run  # noqa: E402

SEEDS = (1234, 1235)
# Each size: its overrides of the demo config, the width of one branch (s_b), the hashed tables'
# capacity, the main run's insertion layers and the depth sweep's.  Variants keep every remaining
# branch identical, so "no unigram" and Engram drop exactly the unigram tables (as the presets do).
SIZES = {
    "cpu-tiny": dict(overrides=[], width=32, capacity=16384, depth=([0], [3], [0, 3])),
    "gpu": dict(overrides=["model.hidden_size=768", "model.num_layers=12", "model.num_attention_heads=12",
                           "model.ffn_hidden_size=2048", "model.seq_length=1024", "model.vocab_size=32000",
                           "memory.table_capacity=[32000,250000,250000]", "memory.coeff_width=1536",
                           "memory.memory_dim=1536", "memory.layers=[5,6]", "training.micro_batch_size=8",
                           "training.global_batch_size=64"],
                width=256, capacity=250000, depth=([1], [10], [1, 10])),
}


def groups(size: str) -> dict:
    """The runs of each group at ``size``: ``{group: [(name, overrides)]}``."""
    spec = SIZES[size]
    no_unigram = ["memory.ngram_orders=[2,3]", f"memory.table_capacity=[{spec['capacity']},{spec['capacity']}]",
                  f"memory.coeff_width={4 * spec['width']}"]
    engram = no_unigram + ["memory.kind=engram", "memory.gate=scalar", f"memory.memory_dim={4 * spec['width']}",
                           "memory.sparsity_lambda=0.0"]
    depth = [(("layer " if len(layers) == 1 else "layers ") + " & ".join(map(str, layers)),
              [f"memory.layers=[{','.join(map(str, layers))}]"]) for layers in spec["depth"]]
    return {
        "main": [("transformer", ["memory=null"]), ("engram", engram), ("factorengram", [])],
        "components": [("scalar gate", ["memory.gate=scalar"]), ("no unigram", no_unigram),
                       ("engram + unigram", ["memory.kind=engram", "memory.gate=scalar",
                                             f"memory.memory_dim={6 * spec['width']}", "memory.sparsity_lambda=0.0"])],
        "lambda": [("lambda 0", ["memory.sparsity_lambda=0.0"]), ("lambda 1e-4", ["memory.sparsity_lambda=1e-4"]),
                   ("lambda 1e-2", ["memory.sparsity_lambda=1e-2"])],
        "placement": [("before FFN", ["memory.placement=before_ffn"]),
                      ("inside FFN", ["memory.placement=inside_ffn"])],
        "depth": depth,
        # Table 8's weight decay on the tables too (the demo config exempts them, as Engram does)
        "weight decay": [("tables decayed (paper)", ["optimizer.table_weight_decay_mult=1.0"])],
    }


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def finished(run_dir: str) -> bool:
    path = os.path.join(run_dir, "metrics.jsonl")
    return os.path.isfile(path) and any(r.get("event") == "final" for r in read_metrics(path))


def summary(run_dir: str) -> dict:
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    final = next(r for r in reversed(rows) if r.get("event") == "final")
    val = [r for r in rows if "val_ppl" in r][-1]
    return {"val_ppl": val["val_ppl"], "test_ppl": final["test_ppl"], "parameters": final["parameters"],
            "curve": [(r["step"], r["lm_loss"]) for r in rows if "lm_loss" in r]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu-tiny")
    parser.add_argument("--out", default="runs/reproduce")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    parser.add_argument("--corpus", default=CORPUS, help="jsonl(.gz) corpus (default: the bundled one)")
    parser.add_argument("--groups", help="comma-separated groups to run (default: all)")
    args = parser.parse_args()
    plan = groups(args.size)
    chosen = args.groups.split(",") if args.groups else list(plan)
    unknown = [name for name in chosen if name not in plan]
    if unknown:
        parser.error(f"--groups: unknown {unknown}; choose from {', '.join(plan)}")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    py = sys.executable
    vocab = 32000 if args.size == "gpu" else 4096
    tokenizer, prefix = os.path.join(out, "tokenizer.model"), os.path.join(out, "data", "corpus")
    if not os.path.isfile(tokenizer):
        run([py, "-m", "fe_megatron.data.cli", "train-tokenizer", "--input", args.corpus, "--output-prefix",
             tokenizer[:-len(".model")], "--vocab-size", str(vocab)])
    if not os.path.isfile(prefix + ".idx"):
        run([py, "-m", "fe_megatron.data.cli", "preprocess", "--input", args.corpus, "--tokenizer-model", tokenizer,
             "--output-prefix", prefix, "--no-progress"])
    results = {}
    for group in chosen:
        for name, overrides in plan[group]:
            for seed in (SEEDS if group == "main" else SEEDS[:1]):
                label = f"{name} (seed {seed})" if group == "main" else name
                run_dir = os.path.join(out, group, f"{slug(name)}_{seed}")
                if not finished(run_dir):
                    run([py, "-m", "fe_megatron.train", "--config", CONFIG, *SIZES[args.size]["overrides"], *overrides,
                         f"data.tokenizer_model={tokenizer}", f"data.train_data=[{prefix}]", f"save={run_dir}",
                         f"data.cache_dir={os.path.join(out, 'cache')}", f"training.seed={seed}",
                         f"training.train_steps={args.steps}", f"training.save_interval={args.steps}",
                         f"training.eval_interval={max(args.steps // 2, 1)}",
                         f"optimizer.warmup_steps={max(args.steps // 15, 1)}"])
                results.setdefault(group, {})[label] = summary(run_dir)
    write_report(out, results, args)
    return 0


def write_report(out: str, results: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main_runs = results.get("main", {})
    reference = {name: value["test_ppl"] for name, value in main_runs.items()}
    lines = [f"Size {args.size}, {args.steps} steps per run; perplexity on the corpus's held-out splits.", ""]
    for group, runs in results.items():
        lines += [f"### {group}", "", "| run | val ppl | test ppl | parameters |", "|---|---|---|---|"]
        for name, value in runs.items():
            lines.append(f"| {name} | {value['val_ppl']:.2f} | {value['test_ppl']:.2f} | {value['parameters']:,} |")
        lines.append("")
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name, value in runs.items():
            ax.plot(*zip(*value["curve"]), label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("training LM loss (nats/token)")
        ax.set_title(f"{group} ({args.size})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"curves_{slug(group)}.png"), dpi=110)
        plt.close(fig)
    if reference:
        pairs = {}
        for name, ppl in reference.items():
            pairs.setdefault(name.split(" (seed")[0], []).append(ppl)
        noise = {name: abs(v[0] - v[1]) for name, v in pairs.items() if len(v) == 2}
        lines += ["Seed-to-seed difference of test perplexity (main group): "
                  + ", ".join(f"{name} {value:.2f}" for name, value in noise.items()), ""]
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write("\n".join(lines))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({group: {name: {k: v for k, v in value.items() if k != "curve"} for name, value in runs.items()}
                   for group, runs in results.items()}, fh, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
