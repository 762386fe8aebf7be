"""``fe-plan``: print the parameter budget of a preset or a YAML config, and its per-rank memory."""

import argparse
import sys

from fe_megatron.config import TABLE_PLACEMENTS, ConfigError, MemoryConfig
from fe_megatron.planning.budget import format_budget
from fe_megatron.memory.sharding import MEGATRON_TABLE_SHARDINGS
from fe_megatron.planning.rank_memory import (DTYPE_BYTES, TableStorage, format_rank_memory,
                                              format_table_storage_choices)

DESCRIPTION = ("Print the parameter budget of a memory preset or a YAML config: the backbone, the tables per "
               "n-gram order and layer, the dictionary and projections, and the total (last line: total_params=N). "
               "With a parallel layout (--tp, --pp, --dp, --table-sharding) it first prints what one rank holds: "
               "weights, gradients and optimizer state of the tables and of the rest, the row exchange's "
               "bytes per step, and what the tables take per rank for every way of keeping them.")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fe-plan", description=DESCRIPTION)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help=f"one of: {', '.join(MemoryConfig.preset_names())}")
    source.add_argument("--config", help="a YAML file of MemoryConfig fields, or a training config")
    layout = parser.add_argument_group("per-rank memory")
    layout.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel size (default 1)")
    layout.add_argument("--pp", type=positive_int, default=None, help="pipeline-parallel size (default 1)")
    layout.add_argument("--dp", type=positive_int, default=None, help="data-parallel size (default 1)")
    layout.add_argument("--table-sharding", choices=MEGATRON_TABLE_SHARDINGS, default=None,
                        help="tables whole on every data-parallel rank, or their rows sharded (default replicated)")
    layout.add_argument("--distributed-optimizer", action="store_true", help="shard optimizer states over DP")
    layout.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="backbone weights (default bf16)")
    layout.add_argument("--micro-batch-size", type=positive_int, default=1, help="for the row exchange (default 1)")
    layout.add_argument("--seq-length", type=positive_int, default=None, help="default: the backbone's")
    layout.add_argument("--global-batch-size", type=positive_int, default=64, help="sequences per step (default 64)")
    layout.add_argument("--device-memory", type=float, default=80.0,
                        help="GiB per accelerator, for the storage choices' 'fits' column (default 80)")
    layout.add_argument("--host-memory", type=float, default=1024.0,
                        help="GiB of host memory per node, for the host tier's 'fits' (default 1024)")
    layout.add_argument("--ranks-per-node", type=positive_int, default=8,
                        help="ranks sharing a node's host memory (default 8)")
    storage = parser.add_argument_group("table storage (the per-rank summary; the choices table shows them all)")
    storage.add_argument("--table-dtype", choices=tuple(DTYPE_BYTES), default="fp32", help="memory.table_dtype")
    storage.add_argument("--table-state-dtype", choices=tuple(DTYPE_BYTES), default="fp32",
                         help="optimizer.table_state_dtype: the tables' gradient and Adam moments")
    storage.add_argument("--table-placement", choices=TABLE_PLACEMENTS, default="device",
                         help="memory.table_placement")
    args = parser.parse_args(argv)
    try:
        if args.preset:
            config, name = MemoryConfig.from_preset(args.preset), args.preset
        else:
            config, name = MemoryConfig.from_yaml(args.config), args.config
        if any(value is not None for value in (args.tp, args.pp, args.dp, args.table_sharding)):
            tp, pp, dp = args.tp or 1, args.pp or 1, args.dp or 1
            if args.global_batch_size % (args.micro_batch_size * dp):
                raise ValueError(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                                 f"--micro-batch-size x --dp = {args.micro_batch_size} x {dp}")
            storage = TableStorage(args.table_dtype, args.table_state_dtype, args.table_placement)
            print(format_rank_memory(config, tp, pp, dp, args.table_sharding or "replicated",
                                     args.distributed_optimizer, args.precision, args.micro_batch_size,
                                     args.seq_length or config.backbone.seq_length, args.global_batch_size, storage))
            print(format_table_storage_choices(config, tp, pp, dp, args.precision, args.device_memory,
                                               args.distributed_optimizer, args.host_memory, args.ranks_per_node))
    except (ConfigError, ValueError) as err:
        print(f"fe-plan: error: {err}", file=sys.stderr)
        return 2
    print(format_budget(config, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
