"""Node-shared tables (parallel.table_sharding: node) in fe-pretrain: one copy per node in shared
memory, trained exactly as row-sharded tables are, in both engines, and nothing left in the folder."""

import os

import pytest

from fe_megatron.tables.node_shared import PREFIX
from tests.helpers.training import CONFIG, curve, metrics, run_pretrain, small_overrides

HOST_TABLES = {"memory.table_placement": "host", "training.train_steps": 6, "training.log_interval": 1,
               "training.save_interval": 6, "training.eval_interval": 6}


def segments(folder) -> list:
    return sorted(name for name in os.listdir(folder) if name.startswith(PREFIX))


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_node_shared_tables_train_as_row_sharded_ones(small_data, tmp_path, engine):
    """DP=2 on one host: the same losses, bit for bit, as row-sharded host tables; the start-up line says
    where the tables are, and the run leaves no segment in its folder."""
    folder = tmp_path / "shm"
    folder.mkdir()
    curves = {}
    for sharding in ("rows", "node"):
        save = str(tmp_path / sharding)
        out = run_pretrain(["--config", CONFIG, "--save", save] + small_overrides(
            small_data, **HOST_TABLES, **{"training.engine": engine, "parallel.table_sharding": sharding,
                                          "parallel.shared_table_folder": str(folder)}), nproc=2).stdout
        curves[sharding] = curve(metrics(save))
    assert f"in shared host memory ({folder}), one copy per node" in out, out[-3000:]
    assert len(curves["node"]) >= 6 and curves["node"] == curves["rows"]
    assert segments(folder) == []
