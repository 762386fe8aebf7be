"""Seconds of ``fe-eval ppl`` (rolling-window perplexity) against a plain unbatched loop.

The baseline is what one would write with transformers alone: for each document, each rolling
window goes through the model by itself (batch 1, fp32) and the new tokens' log-probabilities are
taken with a float64 log-softmax, the same windows and the same tokens as ``fe-eval``
(``fe_megatron.evaluation.tasks.perplexity``).  Both run in the same process on the same
transformers directory (a 4-layer d=64 FactorEngram model with random weights and a sentencepiece
tokenizer trained on the bundled corpus) and the same held-out paragraphs (State of the Union
addresses the tokenizer did not see, cut into paragraphs of about 800 characters); tokenization
is timed in both.  Each is timed ``--repeats`` times, interleaved; the minimum is reported.  The
script checks that both give the same total NLL (fp32 tolerance) before printing.

    python benchmarks/bench_eval_ppl.py [--docs 40] [--repeats 3] [--batch-sizes 1 0]

``--batch-sizes``: the fe-eval batch sizes to time (windows per forward pass; 1 scores one window
at a time as fe-eval did before it batched, 0 means fe-eval's default).
"""

import argparse
import gzip
import inspect
import json
import math
import os
import platform
import re
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fe_megatron.config import BackboneConfig, MemoryConfig  # noqa: E402
from fe_megatron.evaluation import tasks  # noqa: E402
from fe_megatron.evaluation.model import EvalModel  # noqa: E402

CORPUS = os.path.join(ROOT, "data", "sotu.jsonl.gz")


def paragraphs(count: int, skip: int, chars: int = 800) -> list:
    """``count`` paragraphs of about ``chars`` characters (whole sentences) from the addresses after
    the first ``skip``."""
    out = []
    with gzip.open(CORPUS, "rt") as fh:
        for index, line in enumerate(fh):
            if index < skip:
                continue
            sentences, current = re.split(r"(?<=[.!?])\s+", json.loads(line)["text"]), ""
            for sentence in sentences:
                current = f"{current} {sentence}".strip()
                if len(current) >= chars:
                    out.append(current)
                    current = ""
                    if len(out) == count:
                        return out
    return out


def build_model(directory: str, vocab: int, length: int) -> None:
    """A 4-layer d=64 FactorEngram model (memory on layers 1 and 2) with a tokenizer, saved as a
    transformers directory (what ``fe-convert mcore-to-hf`` writes)."""
    from fe_megatron.data.cli import main as fe_data
    from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM, save_tokenizer

    train = os.path.join(directory, "train.jsonl")
    with gzip.open(CORPUS, "rt") as src, open(train, "w") as dst:
        for index, line in enumerate(src):
            if index >= 100:
                break
            dst.write(line)
    assert fe_data(["train-tokenizer", "--input", train, "--output-prefix", os.path.join(directory, "tok"),
                    "--vocab-size", str(vocab)]) == 0
    backbone = BackboneConfig(vocab_size=vocab, hidden_size=64, num_layers=4, num_attention_heads=4,
                              ffn_hidden_size=192, seq_length=length)
    memory = MemoryConfig(backbone=backbone, ngram_orders=[1, 2, 3], heads_per_order=2,
                          table_capacity=[vocab, 16384, 16384], coeff_width=192, memory_dim=128, layers=[1, 2],
                          conv_kernel_size=4, conv_dilation=3)
    torch.manual_seed(0)
    model = FactorEngramForCausalLM(FactorEngramConfig.from_fe_megatron(backbone, memory))
    with torch.no_grad():  # the branch output starts at zero; make it matter
        for name, param in model.named_parameters():
            if ".memory." in name and ("value_proj" in name or "conv.weight" in name):
                param.normal_(0, 0.2)
    hf_dir = os.path.join(directory, "hf")
    model.save_pretrained(hf_dir)
    save_tokenizer(os.path.join(directory, "tok.model"), hf_dir)


@torch.no_grad()
def plain_loop(model, tokenizer, documents: list, length: int, stride: int) -> tuple:
    """``(total NLL, tokens)``: one window per forward pass, float64 log-softmax."""
    nll, tokens = 0.0, 0
    for text in documents:
        ids = tokenizer.encode(text, add_special_tokens=False)
        scored_to = 1
        for begin in range(0, max(len(ids) - 1, 1), stride):
            end = min(begin + length, len(ids))
            if end <= scored_to:
                break
            window = torch.tensor([ids[begin:end]])
            logits = model(window, use_cache=False).logits[0, :-1].double()
            logprobs = torch.log_softmax(logits, -1).gather(1, window[0, 1:].unsqueeze(1)).squeeze(1)
            new = logprobs[scored_to - begin - 1:]
            nll -= float(new.sum())
            tokens += new.numel()
            scored_to = end
            if end == len(ids):
                break
    return nll, tokens


def fe_eval(model, documents: list, stride: int, batch_size: int) -> tuple:
    kwargs = {}
    if "batch_size" in inspect.signature(tasks.perplexity).parameters:
        kwargs = {"batch_size": batch_size} if batch_size else {}
    elif batch_size != 1:
        raise SystemExit("this fe_megatron's perplexity() scores one window at a time: use --batch-sizes 1")
    sums = tasks.perplexity(model, documents, stride, **kwargs)
    return sums["nll"], sums["tokens"]


def timed(function, *args) -> tuple:
    start = time.perf_counter()
    result = function(*args)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=40, help="held-out paragraphs (default 40)")
    parser.add_argument("--length", type=int, default=128, help="the model's sequence length (default 128)")
    parser.add_argument("--stride", type=int, default=0, help="window stride (default: half the length)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 0])
    args = parser.parse_args()
    stride = args.stride or args.length // 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as directory:
        build_model(directory, args.vocab, args.length)
        hf_dir = os.path.join(directory, "hf")
        plain = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        model = EvalModel.load(hf_dir)
        documents = paragraphs(args.docs, skip=200)
        runs = {"plain loop": lambda: plain_loop(plain, tokenizer, documents, args.length, stride)}
        for size in args.batch_sizes:
            runs[f"fe-eval, batch {size or 'default'}"] = lambda size=size: fe_eval(model, documents, stride, size)
        for function in runs.values():  # warm-up
            function()
        seconds = {name: [] for name in runs}
        results = {}
        for _ in range(args.repeats):
            for name, function in runs.items():
                elapsed, results[name] = timed(function)
                seconds[name].append(elapsed)
    reference = results["plain loop"]
    for name, (nll, count) in results.items():
        assert count == reference[1], f"{name} scored {count} tokens, the plain loop {reference[1]}"
        assert math.isclose(nll, reference[0], rel_tol=1e-5), f"{name}: NLL {nll} vs the plain loop's {reference[0]}"
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} "
          f"threads); {len(documents)} paragraphs, {reference[1]} scored tokens, windows of {args.length} tokens, "
          f"stride {stride}; min of {args.repeats}; same NLL (rel 1e-5): {reference[0] / reference[1]:.6f} nats/token")
    base = min(seconds["plain loop"])
    print(f"{'path':<24} {'seconds':>8} {'x plain loop':>13}")
    for name, values in seconds.items():
        print(f"{name:<24} {min(values):8.3f} {min(values) / base:13.2f}")


if __name__ == "__main__":
    main()
