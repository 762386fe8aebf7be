"""``fe-eval``: evaluate a trained model (a run directory at any TP/PP, or a transformers directory).

    fe-eval ppl     --load RUN --data FILE [FILE ...] [--stride N] [--batch-size N]
    fe-eval lambada --load RUN --data FILE
    fe-eval mc      --load RUN --data FILE [FILE ...]
    fe-eval niah    --load RUN --haystack FILE --context 512,1024 [--variant 1,2,3] [--depths ...]

Every subcommand prints a table and writes JSON (``--output``, default
``RUN/eval/<command>-<input file names>.json``, numbered ``-2``, ``-3``, .. rather than replace the
results of another evaluation: another model, inputs or settings; ``niah`` also writes a heatmap
PNG per variant beside it).  Under torchrun the items are split over the ranks (each holds the
whole model) and the sums are added up.  ``docs/evaluation.md`` has the file formats;
``examples/eval/`` has a small example file of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from fe_megatron.evaluation import tasks


_STARTED_GROUP = []  # [True] once _distributed started this process's group, which _end_distributed ends


def _distributed():
    """``(rank, world)``; starts a gloo group under torchrun."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # first: imported after the group exists (loading a model imports it), torch._dynamo keeps the
        # group alive past its destruction (`fe_megatron.training.distributed.init_process_group`)
        import torch._dynamo  # noqa: F401

        dist.init_process_group("gloo")
        _STARTED_GROUP.append(True)
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _end_distributed() -> None:
    """End the group `_distributed` started, and drop every reference to it, so that its gloo threads
    are joined now: left to Python's exit, they can abort a finished evaluation (SIGABRT, "terminate
    called without an active exception"; `fe_megatron.training.distributed.destroy_process_groups`).
    A group this process had before fe-eval ran is left to its owner."""
    if _STARTED_GROUP:
        from fe_megatron.training.distributed import destroy_process_groups

        _STARTED_GROUP.clear()
        destroy_process_groups()


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
    stride = (args.stride or model.max_length // 2) if args.command == "ppl" else None
    report = {"model": os.path.abspath(model.source), "command": args.command, "settings": _settings(args, stride)}
    output, replacing = _output_path(args, report) if rank == 0 else (None, None)
    rows, notes = [], []
    if args.command == "ppl":
        for path in args.data:
            documents = list(tasks.iter_documents([path], args.text_key))[rank::world]
            sums = _sum(tasks.perplexity(model, documents, stride, args.batch_size), world)
            rows.append({"file": path, **tasks.summarize_perplexity(sums)})
        columns = ["file", "token_ppl", "word_ppl", "tokens_per_word", "tokens", "words", "documents"]
        report["legend"] = tasks.PPL_LEGEND
        notes.append(tasks.word_ppl_note(rows))
    elif args.command == "lambada":
        for path in args.data:
            items = tasks.read_lambada_items(path)
            sums = _sum(tasks.lambada(model, items[rank::world], path), world)
            rows.append({"file": path, **tasks.summarize_lambada(sums)})
        columns = ["file", "accuracy", "target_word_nll", "target_token_ppl", "target_tokens_per_word", "items"]
        report["legend"] = tasks.LAMBADA_LEGEND
        notes.append(tasks.LAMBADA_NOTE)
    elif args.command == "mc":
        for path in args.data:
            items = tasks.read_mc_items(path)
            sums = _sum(tasks.multiple_choice(model, items[rank::world], path), world)
            rows.append({"file": path, **tasks.summarize_mc(sums)})
        columns = ["file", "acc", "acc_norm", "items"]
    else:
        haystack = tasks.read_haystack(args.haystack)
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        for variant in args.variant:
            cells = _sum(tasks.niah(model, haystack, variant, args.context, args.depths, args.samples, args.seed,
                                    rank, world), world)
            for key, (correct, total) in cells.items():
                context, depth = key.split(",")
                rows.append({"variant": f"NIAH-{variant}", "context": int(context), "depth": float(depth),
                             "accuracy": correct / total, "samples": int(total)})
            report[f"NIAH-{variant}"] = sum(c for c, _ in cells.values()) / sum(t for _, t in cells.values())
            if rank == 0:
                png = f"{os.path.splitext(output)[0]}_niah{variant}.png"
                _heatmap(cells, args.context, args.depths, f"NIAH-{variant}: {os.path.basename(args.load)}", png)
                report[f"heatmap_{variant}"] = png
        columns = ["variant", "context", "depth", "accuracy", "samples"]
    report["results"] = rows
    if rank == 0:
        print(_table(rows, columns))
        for note in notes:
            print(note)
        if args.command == "niah":
            print("  ".join(f"NIAH-{v}: {report[f'NIAH-{v}']:.3f}" for v in args.variant))
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote the results to {output}{replacing}")
    return report


_EXTENSIONS = (".jsonl.gz", ".json.gz", ".txt.gz", ".jsonl", ".json", ".txt", ".parquet")


def _stem(path: str) -> str:
    """A file name without its folder and data extension, safe in a file name (``hf:a/b`` -> ``hf_a_b``)."""
    name = os.path.basename(path) if not path.startswith("hf:") else path
    for extension in _EXTENSIONS:
        if name.endswith(extension) and len(name) > len(extension):
            name = name[:-len(extension)]
            break
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def _settings(args, stride) -> dict:
    """What, besides the model, makes one evaluation differ from another: the inputs (absolute
    paths) and the options that change the numbers."""
    if args.command == "niah":
        return {"haystack": os.path.abspath(args.haystack), "context": args.context, "variant": args.variant,
                "depths": args.depths, "samples": args.samples, "seed": args.seed}
    data = [p if p.startswith("hf:") else os.path.abspath(p) for p in args.data]
    return {"data": data, **({"stride": stride, "text_key": args.text_key} if args.command == "ppl" else {})}


def _same_evaluation(path: str, report: dict) -> bool:
    try:
        with open(path) as fh:
            earlier = json.load(fh)
    except (OSError, ValueError):
        return False
    return isinstance(earlier, dict) and all(earlier.get(k) == report[k] for k in ("model", "command", "settings"))


def _output_path(args, report: dict) -> tuple:
    """``(JSON path, what writing it replaces: "" or a note)``.  ``--output`` is written as given.
    The default, ``LOAD/eval/COMMAND-STEMS.json`` (STEMS: the input file names), is replaced only
    by a rerun of the same evaluation (the same model, inputs and settings); the results of
    another are kept, and the next free ``-2``, ``-3``, .. name is taken."""
    if args.output:
        if not os.path.exists(args.output):
            return args.output, ""
        same = _same_evaluation(args.output, report)
        return args.output, (" (replacing the earlier results of the same evaluation)" if same else
                             " (replacing what it held: --output names the file to write)")
    base = args.load if os.path.isdir(args.load) else os.path.dirname(args.load)
    inputs = [args.haystack] if args.command == "niah" else args.data
    stems = "+".join(_stem(path) for path in inputs)
    if len(stems) > 80:
        stems = f"{_stem(inputs[0])}+{len(inputs) - 1}-more"
    name = os.path.join(base, "eval", f"{args.command}-{stems}")
    path, number = f"{name}.json", 1
    while os.path.exists(path) and not _same_evaluation(path, report):
        number += 1
        path = f"{name}-{number}.json"
    if number > 1:
        return path, f" ({name}.json holds the results of another evaluation (model, inputs or settings) and is kept)"
    return path, " (replacing the earlier results of the same evaluation)" if os.path.exists(path) else ""


def main(argv=None) -> int:
    from fe_megatron.training.error_file import tell_the_launcher
    from fe_megatron.training.third_party_warnings import silence_known_third_party_warnings

    silence_known_third_party_warnings()
    parser = argparse.ArgumentParser(prog="fe-eval", description=__doc__.split("\n\n")[0].replace("``", ""))
    commands = parser.add_subparsers(dest="command", required=True)
    helps = {"ppl": "token and word perplexity of txt/jsonl files (rolling windows)",
             "lambada": "last-word accuracy, NLL per target word and perplexity per target token of "
                        "{context, target} (or {text}) items",
             "mc": "multiple choice by log-likelihood, raw and length-normalized, of {context_question, choices, "
                   "label} (or WinoGrande {sentence, option1, option2, label}) items",
             "niah": "needle-in-a-haystack retrieval (NIAH-1/2/3) over a context x depth grid"}
    for name, text in helps.items():
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--load", required=True, help="a run directory (fe-pretrain's --save) or a transformers "
                                                       "model directory")
        sub.add_argument("--iteration", type=int, help="which checkpoint of the run (default: the latest)")
        sub.add_argument("--tokenizer", help="the run's tokenizer, if it has moved since training")
        sub.add_argument("--output", help="JSON file (default: LOAD/eval/COMMAND-INPUT.json, INPUT: the input file "
                                          "names; numbered -2, -3, .. rather than replace another evaluation's)")
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
            sub.add_argument("--batch-size", type=int, help="windows per forward pass (default: as many as hold "
                                                            f"{tasks.BATCH_TOKENS} tokens); changes only the speed")
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
        tell_the_launcher(f"fe-eval {args.command}: error: {err}")  # under torchrun: the end of its log
        code = 2
    else:
        code = 0
    # after an unexpected error the group is left as it is: peers may still be in a collective
    _end_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
