"""``fe-plan``: print the parameter budget of a preset or a YAML config."""

DESCRIPTION = ("Print the parameter budget of a memory preset or a YAML config: the backbone, the tables per "
               "n-gram order and layer, the dictionary and projections, and the total (last line: total_params=N).")

import argparse
import sys

from fe_megatron.budget import format_budget
from fe_megatron.config import ConfigError, MemoryConfig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fe-plan", description=DESCRIPTION)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help=f"one of: {', '.join(MemoryConfig.preset_names())}")
    source.add_argument("--config", help="a YAML file of MemoryConfig fields, or a training config")
    args = parser.parse_args(argv)
    try:
        if args.preset:
            config, name = MemoryConfig.from_preset(args.preset), args.preset
        else:
            config, name = MemoryConfig.from_yaml(args.config), args.config
    except (ConfigError, ValueError) as err:
        print(f"fe-plan: error: {err}", file=sys.stderr)
        return 2
    print(format_budget(config, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
