"""The drop-ins' --fe-table-sharding node: parsed, and refused by name where it cannot run (tables on the
device, context parallelism); fe-pretrain's config refuses the same."""

import argparse

import pytest

from fe_megatron.megatron_lm.arguments import add_factorengram_arguments, refused_combinations
from fe_megatron.tables.plan import TablePlan
from fe_megatron.training.config import ConfigError, load_train_config
from tests.helpers.configs import small_config
from tests.helpers.paths import CONFIG

LAYOUT = dict(calculate_per_token_loss=False, context_parallel_size=1, expert_tensor_parallel_size=None,
              mtp_num_layers=None, num_experts=None, pipeline_model_parallel_size=1, recompute_granularity=None,
              sequence_parallel=False, tensor_model_parallel_size=1, virtual_pipeline_model_parallel_size=None)


def arguments(*argv, **layout) -> argparse.Namespace:
    args = add_factorengram_arguments(argparse.ArgumentParser()).parse_args(["--fe-table-sharding", "node", *argv])
    for name, value in {**LAYOUT, **layout}.items():
        setattr(args, name, value)
    return args


def test_node_shared_tables_need_host_placement_and_no_context_parallelism():
    args = arguments("--fe-shared-table-folder", "/mnt/fe-tables")
    assert args.fe_shared_table_folder == "/mnt/fe-tables"
    device, host = small_config(), small_config(table_placement="host")
    assert refused_combinations(args, host) == []
    [problem] = refused_combinations(args, device)
    assert "--fe-table-sharding node" in problem and "--fe-table-placement host" in problem
    [problem] = refused_combinations(arguments(context_parallel_size=2), host)
    assert "--fe-table-sharding node with --context-parallel-size > 1" in problem


def test_fe_pretrain_refuses_node_shared_tables_on_the_device():
    with pytest.raises(ConfigError, match=r"memory.table_placement: "
                                          r"'device': node-shared tables .* set memory.table_placement: host"):
        load_train_config(CONFIG, ["parallel.table_sharding=node"])
    config = load_train_config(CONFIG, ["parallel.table_sharding=node", "memory.table_placement=host"])
    assert TablePlan.for_run(config).describe().startswith("tables fp32 in stores in shared host memory (/dev/shm), "
                                                           "one copy per node, node")
