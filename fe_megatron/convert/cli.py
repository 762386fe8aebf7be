"""``fe-convert``: Megatron checkpoints to Hugging Face and back, and grafting memory onto a Llama.

* ``mcore-to-hf --load RUN_DIR [--iteration N] --output HF_DIR``: a distributed checkpoint of any
  TP/PP/DP layout and table sharding (its tensors are stored whole, by global name) becomes a
  `FactorEngramForCausalLM` directory: safetensors shards, the config, the modeling files and
  the tokenizer.  Tensors are read one at a time from the checkpoint and written straight to
  the shard files (`safetensors_stream`), so no table is ever held twice.
* ``hf-to-mcore --input HF_DIR --output RUN_DIR --tp T --pp P``: the inverse.  It builds the
  Megatron model in this process, copies the weights in (tables in row blocks, read from the
  memory-mapped safetensors) and saves a weights-only checkpoint that ``fe-pretrain --load``
  starts from at step 0 with a fresh optimizer, at any layout; ``RUN_DIR/train.yaml`` holds the
  model, memory and ``--tp``/``--pp`` to train with.
* ``graft --base HF_LLAMA_DIR_OR_GGUF --memory-preset NAME --output RUN_DIR``: a pretrained
  Llama-architecture model plus freshly initialized memory branches, whose output starts at
  exactly zero (``value_proj`` is zero), so the grafted model computes the base model's logits
  until training moves it.

Every command writes into ``OUTPUT.tmp`` and renames it at the end: a failed conversion leaves
nothing half-written under ``OUTPUT``.
"""

from __future__ import annotations

import argparse
import sys

from fe_megatron.checkpoint.files import CheckpointError
from fe_megatron.config import TABLE_DTYPES, ConfigError
from fe_megatron.convert.common import ConversionError
from fe_megatron.memory.sharding import MEGATRON_TABLE_SHARDINGS
from fe_megatron.presets import PRESETS


def build_parser() -> argparse.ArgumentParser:
    """fe-convert's subcommands and their flags."""
    parser = argparse.ArgumentParser(prog="fe-convert", description=__doc__.split("\n\n")[0].replace("``", ""))
    commands = parser.add_subparsers(dest="command", required=True)
    to_hf = commands.add_parser("mcore-to-hf", help="an fe-pretrain checkpoint -> a transformers directory")
    to_hf.add_argument("--load", required=True, help="the run directory (fe-pretrain's --save)")
    to_hf.add_argument("--iteration", type=int, help="which checkpoint (default: the latest)")
    to_hf.add_argument("--output", required=True, help="a new directory for the transformers model")
    to_hf.add_argument("--tokenizer", help="the run's tokenizer, if it has moved since training")
    to_mcore = commands.add_parser("hf-to-mcore", help="a transformers directory -> an fe-pretrain run directory")
    to_mcore.add_argument("--input", required=True, help="a FactorEngramForCausalLM (or Llama) directory")
    to_mcore.add_argument("--output", required=True, help="a new run directory")
    from_ds = commands.add_parser("deepspeed-to-hf", help="a DeepSpeed-engine checkpoint -> a transformers directory")
    from_ds.add_argument("--load", required=True, help="the run directory (fe-pretrain's --save) or an iter_* folder")
    from_ds.add_argument("--tag", help="which checkpoint, e.g. iter_0000100 (default: the one 'latest' names)")
    from_ds.add_argument("--output", required=True, help="a new directory for the transformers model")
    from_ds.add_argument("--tokenizer", help="the run's tokenizer, if it has moved since training")
    for sub in (to_hf, from_ds):
        sub.add_argument("--table-dtype", choices=TABLE_DTYPES,
                         help="how the tables are stored: fp32, bf16, or fp8 (e4m3 with one scale per row); "
                              "default: as trained (memory.table_dtype); docs/tables.md gives the perplexity and "
                              "bytes of each")
    graft_cmd = commands.add_parser("graft", help="add memory branches to a pretrained Llama")
    graft_cmd.add_argument("--base", required=True, help="a transformers Llama directory or a .gguf file")
    graft_cmd.add_argument("--memory-preset", required=True, choices=sorted(PRESETS), metavar="PRESET",
                           help=f"a memory preset: {', '.join(sorted(PRESETS))} (fe-plan --preset NAME shows one)")
    graft_cmd.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")],
                           help="0-based insertion layers, comma-separated (default: the preset's)")
    graft_cmd.add_argument("--output", required=True, help="a new run directory")
    graft_cmd.add_argument("--seed", type=int, default=1234, help="seed of the memory's initialization")
    for sub in (to_mcore, graft_cmd):
        sub.add_argument("--tp", type=int, default=1, help="tensor-parallel size to train with (train.yaml)")
        sub.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to train with (train.yaml)")
        sub.add_argument("--table-sharding", default=None, choices=MEGATRON_TABLE_SHARDINGS,
                         help="the tables' sharding to train with (train.yaml; default: the run's, else replicated)")
    return parser


def run_command(args) -> None:
    """Run the chosen conversion, then print what it wrote and how to use it."""
    from fe_megatron.convert.graft import graft
    from fe_megatron.convert.to_hf import mcore_to_hf
    from fe_megatron.convert.to_mcore import hf_to_mcore, train_yaml_header

    if args.command == "mcore-to-hf":
        out = mcore_to_hf(args.load, args.output, args.iteration, args.tokenizer, table_dtype=args.table_dtype)
        print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({out!r}) after import "
              "fe_megatron.hf, or with trust_remote_code=True")
    elif args.command == "deepspeed-to-hf":
        from fe_megatron.convert.deepspeed_to_hf import deepspeed_to_hf

        out = deepspeed_to_hf(args.load, args.output, args.tag, args.tokenizer, table_dtype=args.table_dtype)
        print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({out!r}) after import "
              "fe_megatron.hf, or with trust_remote_code=True")
    elif args.command == "hf-to-mcore":
        out = hf_to_mcore(args.input, args.output, args.tp, args.pp, args.table_sharding)
        print(f"wrote {out}. " + " ".join(train_yaml_header(out)))
    else:
        out = graft(args.base, args.memory_preset, args.output, args.layers, args.tp, args.pp,
                    args.table_sharding, args.seed)
        print(f"wrote {out}. " + " ".join(train_yaml_header(out))
              + " (training.freeze_backbone=true trains the memory only)")


def main(argv=None) -> int:
    from fe_megatron.training.third_party_warnings import silence_known_third_party_warnings

    silence_known_third_party_warnings()
    args = build_parser().parse_args(argv)
    try:
        run_command(args)
    except (ConversionError, CheckpointError, ConfigError, FileNotFoundError) as err:
        print(f"fe-convert {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
