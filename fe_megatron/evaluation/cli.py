"""``fe-eval``: evaluate a trained model (a run directory at any TP/PP, or a transformers directory).

    fe-eval ppl     --load RUN --data FILE [FILE ...] [--stride N]
    fe-eval lambada --load RUN --data FILE
    fe-eval mc      --load RUN --data FILE [FILE ...]
    fe-eval niah    --load RUN --haystack FILE --context 512,1024 [--variant 1,2,3] [--depths ...]

Every subcommand prints a table and writes JSON (``--output``, default ``RUN/eval/<command>.json``;
``niah`` also writes a heatmap PNG per variant beside it).  Under torchrun the items are split over
the ranks (each holds the whole model) and the sums are added up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from fe_megatron.evaluation import tasks


def _distributed():
    """``(rank, world)``; starts a gloo group under torchrun."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _sum(values: dict, world: int) -> dict:
    """Add up numeric values (or lists of them) across ranks."""
    if world == 1:
        return values
    import torch.distributed as dist

    keys = sorted(values)
    flat = torch.tensor([float(x) for key in keys for x in (values[key] if isinstance(values[key], list)
                                                            else [values[key]])], dtype=torch.float64)
    dist.all_reduce(flat)
    out, index = {}, 0
    for key in keys:
        width = len(values[key]) if isinstance(values[key], list) else 1
        part = flat[index:index + width].tolist()
        out[key] = part if isinstance(values[key], list) else part[0]
        index += width
    return out


def _table(rows: list, columns: list) -> str:
    widths = [max(len(str(c)), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.1f}"
    return "" if value is None else str(value)


def _ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list:
    return [float(x) for x in text.split(",") if x]


def _heatmap(cells: dict, contexts: list, depths: list, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [[cells[f"{c},{d}"][0] / max(cells[f"{c},{d}"][1], 1) for c in contexts] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 * len(contexts) + 2, 0.6 * len(depths) + 1.5))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(contexts)), [str(c) for c in contexts])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args) -> dict:
    from fe_megatron.evaluation.model import EvalModel

    rank, world = _distributed()
    model = EvalModel.load(args.load, args.iteration, args.tokenizer)
    report = {"model": model.source, "command": args.command}
    rows = []
    if args.command == "ppl":
        for path in args.data:
            documents = list(tasks.iter_documents([path], args.text_key))[rank::world]
            sums = _sum(tasks.perplexity(model, documents, args.stride or model.max_length // 2), world)
            rows.append({"file": path, **tasks.summarize_perplexity(sums)})
        columns = ["file", "token_ppl", "word_ppl", "tokens", "words", "documents"]
    elif args.command == "lambada":
        for path in args.data:
            items = tasks.read_items(path, ())
            for line, record in items:
                if not ({"context", "target"} <= set(record) or "text" in record):
                    raise tasks.DataError(f"{path}:{line}: expected 'context' and 'target' fields (or 'text', whose "
                                          f"last word is the target), found {sorted(record)}")
            sums = _sum(tasks.lambada(model, items[rank::world], path), world)
            rows.append({"file": path, **tasks.summarize_lambada(sums)})
        columns = ["file", "accuracy", "target_nll", "ppl", "items"]
    elif args.command == "mc":
        for path in args.data:
            items = tasks.read_items(path, ("label",))
            sums = _sum(tasks.multiple_choice(model, items[rank::world], path), world)
            rows.append({"file": path, **tasks.summarize_mc(sums)})
        columns = ["file", "acc", "acc_norm", "items"]
    else:
        haystack = tasks.read_haystack(args.haystack)
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(_output_path(args))), exist_ok=True)
        for variant in args.variant:
            cells = _sum(tasks.niah(model, haystack, variant, args.context, args.depths, args.samples, args.seed,
                                    rank, world), world)
            for key, (correct, total) in cells.items():
                context, depth = key.split(",")
                rows.append({"variant": f"NIAH-{variant}", "context": int(context), "depth": float(depth),
                             "accuracy": correct / total, "samples": int(total)})
            report[f"NIAH-{variant}"] = sum(c for c, _ in cells.values()) / sum(t for _, t in cells.values())
            if rank == 0:
                png = f"{os.path.splitext(_output_path(args))[0]}_niah{variant}.png"
                _heatmap(cells, args.context, args.depths, f"NIAH-{variant}: {os.path.basename(args.load)}", png)
                report[f"heatmap_{variant}"] = png
        columns = ["variant", "context", "depth", "accuracy", "samples"]
    report["results"] = rows
    if rank == 0:
        print(_table(rows, columns))
        if args.command == "niah":
            print("  ".join(f"NIAH-{v}: {report[f'NIAH-{v}']:.3f}" for v in args.variant))
        path = _output_path(args)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {path}")
    return report


def _output_path(args) -> str:
    if args.output:
        return args.output
    base = args.load if os.path.isdir(args.load) else os.path.dirname(args.load)
    return os.path.join(base, "eval", f"{args.command}.json")


def main(argv=None) -> int:
    from fe_megatron.training.third_party_warnings import silence_known_third_party_warnings

    silence_known_third_party_warnings()
    parser = argparse.ArgumentParser(prog="fe-eval", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    helps = {"ppl": "token and word perplexity of txt/jsonl files (rolling windows)",
             "lambada": "last-word accuracy and target NLL of {context, target} (or {text}) items",
             "mc": "multiple choice by log-likelihood, raw and length-normalized",
             "niah": "needle-in-a-haystack retrieval (NIAH-1/2/3) over a context x depth grid"}
    for name, text in helps.items():
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--load", required=True, help="a run directory (fe-pretrain's --save) or a transformers "
                                                       "model directory")
        sub.add_argument("--iteration", type=int, help="which checkpoint of the run (default: the latest)")
        sub.add_argument("--tokenizer", help="the run's tokenizer, if it has moved since training")
        sub.add_argument("--output", help="JSON file (default: LOAD/eval/COMMAND.json)")
        if name == "niah":
            sub.add_argument("--haystack", required=True, help="txt/jsonl text to hide the needles in")
            sub.add_argument("--context", type=_ints, required=True, help="context lengths, e.g. 1024,2048")
            sub.add_argument("--variant", type=_ints, default=[1, 2, 3], help="NIAH variants (default 1,2,3)")
            sub.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
            sub.add_argument("--samples", type=int, default=4, help="samples per cell")
            sub.add_argument("--seed", type=int, default=0)
        else:
            sub.add_argument("--data", nargs="+", required=True, help="evaluation files")
        if name == "ppl":
            sub.add_argument("--stride", type=int, help="window stride in tokens (default: half the model's length)")
            sub.add_argument("--text-key", default="text", help="jsonl field holding the text")
    args = parser.parse_args(argv)
    try:
        if args.command == "niah":
            if not args.context or any(v not in (1, 2, 3) for v in args.variant):
                raise ValueError(f"--context needs at least one length and --variant values in 1,2,3; got "
                                 f"{args.context} and {args.variant}")
            if args.samples < 1 or any(not 0.0 <= d <= 1.0 for d in args.depths):
                raise ValueError(f"--samples must be >= 1 and --depths within [0, 1]; got {args.samples} and "
                                 f"{args.depths}")
        run(args)
    except (ValueError, FileNotFoundError) as err:  # DataError, CheckpointError, ConversionError included
        print(f"fe-eval {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
