"""``fe-plan``: print the parameter budget of a preset or a YAML config, and its per-rank memory."""

import argparse
import sys

from fe_megatron.config import TABLE_PLACEMENTS, ConfigError, MemoryConfig
from fe_megatron.planning.budget import format_budget
from fe_megatron.memory.sharding import MEGATRON_TABLE_SHARDINGS
from fe_megatron.tables.update_rules import TABLE_UPDATES
from fe_megatron.planning.rank_memory import (DTYPE_BYTES, TableStorage, format_rank_memory,
                                              format_table_storage_choices)
from fe_megatron.planning.run_estimates import format_run_estimates

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


# fe-plan's per-rank settings: (flag attribute, where a training config keeps it, default)
SETTINGS = (
    ("tp", "parallel.tensor", 1),
    ("pp", "parallel.pipeline", 1),
    ("dp", None, 1),  # the data-parallel size is the launch's (ranks / (TP x PP)), not the config's
    ("table_sharding", "parallel.table_sharding", "replicated"),
    ("distributed_optimizer", "parallel.distributed_optimizer", False),
    ("precision", "training.precision", "bf16"),
    ("micro_batch_size", "training.micro_batch_size", 1),
    ("global_batch_size", "training.global_batch_size", 64),
    ("seq_length", "model.seq_length", None),
    ("table_dtype", "memory.table_dtype", "fp32"),
    ("table_state_dtype", "optimizer.table_state_dtype", "fp32"),
    ("table_placement", "memory.table_placement", "device"),
    ("table_update", "optimizer.table_update", "adamw"),
)


def _config_value(train_config, dotted: str):
    section, name = dotted.split(".")
    value = getattr(getattr(train_config, section), name)
    if dotted == "training.precision" and value == "auto":
        return "bf16"  # auto is bf16 on a GPU, which is what a plan is for
    return value


def resolve_settings(args, train_config) -> dict:
    """``{name: (value, source)}``: a flag given on the command line wins, then the training config's
    value, then fe-plan's default; ``source`` says which (and the config's field)."""
    settings = {}
    for name, dotted, default in SETTINGS:
        flag = getattr(args, name)
        if flag is not None:
            settings[name] = (flag, f"--{name.replace('_', '-')}")
        elif train_config is not None and dotted is not None:
            settings[name] = (_config_value(train_config, dotted), f"config {dotted}")
        else:
            settings[name] = (default, "default")
    return settings


def format_settings(settings: dict) -> str:
    def shown(value):
        return ("yes" if value else "no") if isinstance(value, bool) else value

    return "# settings: " + ", ".join(f"{name}={shown(value)} ({source})"
                                      for name, (value, source) in settings.items() if value is not None)


def _load(args):
    """(MemoryConfig, its name, the training config or None)."""
    if args.preset:
        return MemoryConfig.from_preset(args.preset), args.preset, None
    from fe_megatron.config import read_yaml_mapping

    top, _ = read_yaml_mapping(args.config)
    if isinstance(top, dict) and {"parallel", "training", "optimizer", "data"} & set(top):
        from fe_megatron.training.config import load_train_config

        # fe-plan reads no data: a config whose data is still to be set (fe-convert's placeholders) plans too
        has_data = isinstance(top.get("data"), dict) and top["data"].get("train_data")
        train_config = load_train_config(args.config, [] if has_data else ["data.train_data=[none]"])
        if train_config.memory is None:
            raise ValueError(f"{args.config} trains no memory (memory: null): there is nothing for fe-plan to plan")
        return train_config.memory, args.config, train_config
    return MemoryConfig.from_yaml(args.config), args.config, None


def build_parser() -> argparse.ArgumentParser:
    """fe-plan's flags: where the memory config comes from, the parallel layout and the table storage."""
    parser = argparse.ArgumentParser(prog="fe-plan", description=DESCRIPTION)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help=f"one of: {', '.join(MemoryConfig.preset_names())}")
    source.add_argument("--config", help="a YAML file of MemoryConfig fields, or a training config, whose parallel, "
                                         "training, optimizer and memory settings are the defaults of the flags below")
    layout = parser.add_argument_group("per-rank memory (a flag overrides the training config's value)")
    layout.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel size (default 1)")
    layout.add_argument("--pp", type=positive_int, default=None, help="pipeline-parallel size (default 1)")
    layout.add_argument("--dp", type=positive_int, default=None, help="data-parallel size (default 1)")
    layout.add_argument("--table-sharding", choices=MEGATRON_TABLE_SHARDINGS, default=None,
                        help="tables whole on every data-parallel rank, or their rows sharded (default replicated)")
    layout.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                        help="shard optimizer states over DP (default no)")
    layout.add_argument("--precision", choices=("bf16", "fp32"), default=None, help="backbone weights (default bf16)")
    layout.add_argument("--micro-batch-size", type=positive_int, default=None,
                        help="for the row exchange and the activations (default 1)")
    layout.add_argument("--seq-length", type=positive_int, default=None, help="default: the backbone's")
    layout.add_argument("--global-batch-size", type=positive_int, default=None, help="sequences per step (default 64)")
    layout.add_argument("--recompute", choices=("none", "full"), default=None,
                        help="activation recompute, for the activation estimate (default: the config's, else none)")
    layout.add_argument("--keep-checkpoints", type=int, default=None,
                        help="checkpoints kept on disk, for the disk estimate (0 = all; default: the config's, else 0)")
    layout.add_argument("--device-memory", type=float, default=80.0,
                        help="GiB per accelerator, for the 'fits' columns (default 80)")
    layout.add_argument("--host-memory", type=float, default=1024.0,
                        help="GiB of host memory per node, for the host tier's 'fits' (default 1024)")
    layout.add_argument("--ranks-per-node", type=positive_int, default=8,
                        help="ranks sharing a node's host memory (default 8)")
    storage = parser.add_argument_group("table storage (the per-rank summary; the choices table shows them all)")
    storage.add_argument("--table-dtype", choices=tuple(DTYPE_BYTES), default=None,
                         help="memory.table_dtype (default fp32)")
    storage.add_argument("--table-state-dtype", choices=tuple(DTYPE_BYTES), default=None,
                         help="optimizer.table_state_dtype: the tables' gradient and Adam moments (default fp32)")
    storage.add_argument("--table-placement", choices=TABLE_PLACEMENTS, default=None,
                         help="memory.table_placement (default device)")
    storage.add_argument("--table-update", choices=TABLE_UPDATES, default=None,
                         help="optimizer.table_update: adamw (every row, default), or a sparse rule that keeps no "
                              "dense gradient (fe_megatron.tables.update_rules; docs/tables.md)")
    return parser


def _run_settings(args, train_config) -> tuple:
    """(recompute, checkpoints kept, saves, sequence_parallel, fused_attention) for the run estimates: a flag wins,
    then the training config's value; saves and the two backbone switches are only known from a training config."""
    recompute = args.recompute or (train_config.training.recompute if train_config is not None else "none")
    keep = args.keep_checkpoints if args.keep_checkpoints is not None else (
        train_config.training.keep_checkpoints if train_config is not None else 0)
    saves, sequence_parallel, fused_attention = None, False, False
    if train_config is not None:
        t = train_config.training
        saves = -(-t.train_steps // t.save_interval) if t.save_interval else 1  # 0: at the end only
        sequence_parallel = train_config.parallel.sequence_parallel
        fused_attention = t.transformer_impl == "te"
    return recompute, keep, saves, sequence_parallel, fused_attention


def print_rank_estimates(args, config, train_config) -> None:
    """Print the resolved settings, what one rank holds, the run's estimates and the table storage choices."""
    settings = resolve_settings(args, train_config)
    value = {key: entry[0] for key, entry in settings.items()}
    if value["seq_length"] is None:
        value["seq_length"], settings["seq_length"] = config.backbone.seq_length, (
            config.backbone.seq_length, "the backbone's")
    tp, pp, dp = value["tp"], value["pp"], value["dp"]
    if value["global_batch_size"] % (value["micro_batch_size"] * dp):
        raise ValueError(f"global batch {value['global_batch_size']} ({settings['global_batch_size'][1]}) is "
                         f"not a multiple of micro-batch x DP = {value['micro_batch_size']} x {dp}")
    recompute, keep, saves, sequence_parallel, fused_attention = _run_settings(args, train_config)
    storage = TableStorage(value["table_dtype"], value["table_state_dtype"], value["table_placement"],
                           value["table_update"])
    print(format_settings(settings))
    print(format_rank_memory(config, tp, pp, dp, value["table_sharding"], value["distributed_optimizer"],
                             value["precision"], value["micro_batch_size"], value["seq_length"],
                             value["global_batch_size"], storage, args.ranks_per_node))
    print(format_run_estimates(config, tp, pp, dp, value["table_sharding"], value["distributed_optimizer"],
                               value["precision"], value["micro_batch_size"], value["seq_length"],
                               value["global_batch_size"], storage, recompute, keep, saves,
                               args.device_memory, sequence_parallel, fused_attention))
    print(format_table_storage_choices(config, tp, pp, dp, value["precision"], args.device_memory,
                                       value["distributed_optimizer"], args.host_memory, args.ranks_per_node))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config, name, train_config = _load(args)
        layout_flags = (args.tp, args.pp, args.dp, args.table_sharding)
        per_rank = any(value is not None for value in layout_flags) or train_config is not None
        if per_rank and config.backbone.num_experts:
            print(f"# per-rank estimates: not made for an MoE backbone (model.num_experts="
                  f"{config.backbone.num_experts}; they do not split experts over expert-parallel ranks); the budget "
                  "below counts every expert")
        elif per_rank:
            print_rank_estimates(args, config, train_config)
    except (ConfigError, ValueError) as err:
        print(f"fe-plan: error: {err}", file=sys.stderr)
        return 2
    print(format_budget(config, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
