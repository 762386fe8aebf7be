"""``fe-inspect``: what the memory of a trained model does on a text, per insertion layer.

    fe-inspect --load RUN --data FILE [--threshold 0.1] [--max-tokens 20000] [--output DIR]

For each insertion layer, over the tokens of ``--data``:
* **sparsity of z** (Eq. 12's coefficients): the fraction of |z| below ``--threshold``;
* **basis usage** (FactorEngram's basis gate): how often each of the s coefficients is active
  after gating, |z_j alpha_j| >= threshold (Eq. 8), and how many are never active;
* **gates by n-gram order**: the mean and spread of alpha (Eq. 7) over the coefficients of each
  order's branches (the scalar gate of Eq. 14 and Engram's gate: one value per position);
* **hash collisions**: per hashed branch, the share of the text's distinct n-grams that share
  their table row with another n-gram of the text.
Writes ``summary.txt``, ``summary.json`` and PNGs (``basis_usage.png``, ``gates_by_order.png``)
to ``--output`` (default ``RUN/inspect``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

from fe_megatron.memory import functional as FM


def _capture_inputs(model) -> tuple:
    """``{layer_index: hidden_states}`` of each memory branch's last call (the residual stream it read), and
    the forward pre-hooks' handles."""
    captured, handles = {}, []
    for layer in model.model.layers:
        memory = getattr(layer, "memory", None)
        if memory is not None:
            def hook(module, args, index=layer.layer_index):
                captured[index] = args[0].detach()
            handles.append(memory.register_forward_pre_hook(hook))
    return captured, handles


@torch.no_grad()
def inspect_memory(eval_model, texts, threshold: float, max_tokens: int) -> dict:
    """The statistics above, per insertion layer, over the first ``max_tokens`` tokens of ``texts``."""
    model = eval_model.model
    captured, handles = _capture_inputs(model)
    layers = {}
    ngrams = defaultdict(lambda: defaultdict(set))  # (layer, branch) -> row -> distinct n-grams
    seen = 0
    try:
        for text in texts:
            if seen >= max_tokens:
                break
            ids = eval_model.encode(text)
            for first in range(0, len(ids), eval_model.max_length):
                window = ids[first:first + eval_model.max_length]
                if seen >= max_tokens or len(window) < 2:
                    break
                token_ids = torch.tensor([window])
                model(token_ids, use_cache=False)
                seen += len(window)
                for index, hidden in captured.items():
                    _accumulate(layers.setdefault(index, _empty(model, index)), model.model.layers[index].memory,
                                hidden, token_ids, threshold, ngrams, index, window)
    finally:
        for handle in handles:
            handle.remove()
    if not layers:
        raise ValueError("the model has no memory branch to inspect (memory: null)")
    return {index: _finish(stats, ngrams, index) for index, stats in sorted(layers.items())}


def _empty(model, index: int) -> dict:
    memory = model.model.layers[index].memory
    return {"kind": memory.kind, "gate": memory.config.gate, "positions": 0, "small": 0, "coefficients": 0,
            "active": torch.zeros(memory.config.coeff_width, dtype=torch.float64),
            "gate_sum": defaultdict(float), "gate_sq": defaultdict(float), "gate_n": defaultdict(int)}


def _accumulate(stats, memory, hidden, token_ids, threshold, ngrams, index, window) -> None:
    z = memory.lookup(hidden, token_ids, None)[0].double()  # [T, s]
    stats["positions"] += z.shape[0]
    stats["small"] += int((z.abs() < threshold).sum())
    stats["coefficients"] += z.numel()
    config = memory.config
    orders = [n for n in config.branch_orders for _ in range(config.branch_width)]  # order of each coefficient
    if memory.kind == "factorengram" and config.gate == "basis":
        alpha = FM.basis_gate(memory.query(hidden), memory.dictionary.flatten(0, 1), config.hidden_size)[0].double()
        stats["active"] += ((z * alpha).abs() >= threshold).sum(0).double()
        for order in sorted(set(orders)):
            columns = torch.tensor([o == order for o in orders])
            values = alpha[:, columns]
            stats["gate_sum"][order] += float(values.sum())
            stats["gate_sq"][order] += float((values ** 2).sum())
            stats["gate_n"][order] += values.numel()
    else:
        stats["active"] += (z.abs() >= threshold).sum(0).double()
        gate = _scalar_gate(memory, hidden, z)
        if gate is not None:
            stats["gate_sum"]["all"] += float(gate.sum())
            stats["gate_sq"]["all"] += float((gate ** 2).sum())
            stats["gate_n"]["all"] += gate.numel()
    rows = memory.hasher.indices(torch.tensor([window]))[0]  # [T, branches]
    for branch, order in enumerate(config.branch_orders):
        if order == 1:
            continue
        for t in range(len(window)):
            gram = tuple(window[max(0, t - order + 1):t + 1])
            ngrams[(index, branch)][int(rows[t, branch])].add(gram)


def _scalar_gate(memory, hidden, z):
    config = memory.config
    if config.gate != "scalar":
        return None
    if memory.kind == "factorengram":
        e = FM.reconstruct(z.to(hidden.dtype)[None], memory.dictionary.flatten(0, 1))
        return FM.scalar_gate(e, memory.query(hidden), config.hidden_size).double().flatten()
    key = memory.key_norm(memory.key_proj(z.to(hidden.dtype)[None]))
    return FM.engram_gate(key, memory.query_norm(hidden), config.hidden_size).double().flatten()


def _finish(stats: dict, ngrams: dict, index: int) -> dict:
    usage = (stats["active"] / max(stats["positions"], 1)).tolist()
    gates = {}
    for order, n in stats["gate_n"].items():
        mean = stats["gate_sum"][order] / n
        gates[str(order)] = {"mean": mean, "std": max(stats["gate_sq"][order] / n - mean ** 2, 0.0) ** 0.5}
    collisions = {}
    for (layer, branch), rows in ngrams.items():
        if layer != index:
            continue
        distinct = sum(len(grams) for grams in rows.values())
        shared = sum(len(grams) for grams in rows.values() if len(grams) > 1)
        collisions[str(branch)] = {"distinct_ngrams": distinct, "sharing_a_row": shared / max(distinct, 1)}
    return {"kind": stats["kind"], "gate": stats["gate"], "positions": stats["positions"],
            "z_below_threshold": stats["small"] / max(stats["coefficients"], 1),
            "basis_usage": usage, "never_active": int(sum(u == 0 for u in usage)),
            "mean_active": sum(usage) / len(usage), "gates_by_order": gates, "collisions": collisions}


def render(summary: dict, threshold: float, output: str, source: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(output, exist_ok=True)
    lines = [f"fe-inspect {source} (threshold {threshold})"]
    fig, axes = plt.subplots(len(summary), 1, figsize=(8, 2.4 * len(summary)), squeeze=False)
    for ax, (index, layer) in zip(axes[:, 0], summary.items()):
        ax.bar(range(len(layer["basis_usage"])), layer["basis_usage"], width=1.0)
        ax.set_title(f"layer {index}: share of positions where each coefficient is active")
        ax.set_xlabel("coefficient j (branches in order of n-gram order, then head)")
        ax.set_ylim(0, 1)
        collisions = ", ".join(f"branch {b} {c['sharing_a_row']:.1%}" for b, c in layer["collisions"].items())
        gates = ", ".join(f"order {o}: {g['mean']:.3f} +- {g['std']:.3f}" for o, g in layer["gates_by_order"].items())
        lines += [f"layer {index} ({layer['kind']}, gate {layer['gate']}, {layer['positions']} positions):",
                  f"  |z| below threshold: {layer['z_below_threshold']:.1%}",
                  f"  coefficients active on average: {layer['mean_active']:.1%}; never active: "
                  f"{layer['never_active']} of {len(layer['basis_usage'])}",
                  f"  gates: {gates or 'none (gate=none)'}",
                  f"  n-grams sharing a row: {collisions or 'no hashed branch'}"]
    fig.tight_layout()
    fig.savefig(os.path.join(output, "basis_usage.png"), dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(len(summary), 1)
    for k, (index, layer) in enumerate(summary.items()):
        names = list(layer["gates_by_order"])
        ax.bar([i + k * width for i in range(len(names))], [layer["gates_by_order"][n]["mean"] for n in names],
               width, yerr=[layer["gates_by_order"][n]["std"] for n in names], label=f"layer {index}")
        ax.set_xticks([i + width * (len(summary) - 1) / 2 for i in range(len(names))],
                      [f"order {n}" if n != "all" else "per position" for n in names])
    ax.set_ylabel("gate alpha (mean, std)")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(output, "gates_by_order.png"), dpi=100)
    plt.close(fig)
    text = "\n".join(lines)
    with open(os.path.join(output, "summary.txt"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(output, "summary.json"), "w") as fh:
        json.dump({str(k): v for k, v in summary.items()}, fh, indent=1)
    return text


def main(argv=None) -> int:
    from fe_megatron.training.third_party_warnings import silence_known_third_party_warnings

    silence_known_third_party_warnings()
    parser = argparse.ArgumentParser(prog="fe-inspect", description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--load", required=True, help="a run directory or a transformers model directory")
    parser.add_argument("--data", required=True, help="txt/jsonl evaluation text")
    parser.add_argument("--iteration", type=int, help="which checkpoint of a run directory (default: the latest)")
    parser.add_argument("--tokenizer", help="the run's tokenizer, if it has moved since training")
    parser.add_argument("--threshold", type=float, default=0.1, help="|value| below it counts as zero")
    parser.add_argument("--max-tokens", type=int, default=20000,
                        help="read the text's first tokens up to about this many, in whole windows of the "
                             "model's context (default 20000)")
    parser.add_argument("--output", help="folder for the summary and PNGs (default LOAD/inspect)")
    args = parser.parse_args(argv)
    from fe_megatron.data.sources import iter_documents
    from fe_megatron.evaluation.model import EvalModel

    try:
        model = EvalModel.load(args.load, args.iteration, args.tokenizer)
        summary = inspect_memory(model, iter_documents([args.data]), args.threshold, args.max_tokens)
    except (ValueError, FileNotFoundError) as err:
        print(f"fe-inspect: error: {err}", file=sys.stderr)
        return 2
    output = args.output or os.path.join(args.load, "inspect")
    print(render(summary, args.threshold, output, model.source))
    read = max(layer["positions"] for layer in summary.values())
    if read >= args.max_tokens:
        print(f"read the first {read:,} tokens of {args.data} (--max-tokens {args.max_tokens}, in whole windows of "
              f"{model.max_length}); the rest of the text was not read")
    else:
        print(f"read all {read:,} tokens of {args.data}")
    print(f"wrote {output}/summary.txt, summary.json, basis_usage.png, gates_by_order.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
