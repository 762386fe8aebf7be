"""`fe_megatron.megatron.table_checkpoint` in one process: a stage's tables and their optimizer state come back
from ``fe_tables/`` exactly, and a checkpoint without this run's tensors is refused naming the first one missing
and the settings to keep. Across ranks, layouts and engines: tests/integration/test_deepspeed.py."""

import pytest
import torch

from fe_megatron.checkpoint.files import CheckpointError
from fe_megatron.memory import FactorEngram
from fe_megatron.tables.plan import TablePlan
from fe_megatron.tables.stage_tables import StageTables
from fe_megatron.training.config import OptimizerArgs
from tests.helpers.configs import small_config

pytest.importorskip("megatron.core", reason="megatron-core is installed by the project's set-up (make setup)")


def stage_tables(update: str, seed: int) -> StageTables:
    torch.manual_seed(seed)
    config = small_config()
    branches = {f"decoder.layers.{layer}.memory": FactorEngram(config, layer) for layer in config.layers}
    for branch in branches.values():
        branch.reset_parameters(seed=seed)
    return StageTables(branches, OptimizerArgs(lr=1e-2), TablePlan.resolve(update=update))


def trained(update: str, seed: int) -> StageTables:
    """Tables after two updates from fresh random gradients."""
    tables = stage_tables(update, seed)
    for _ in range(2):
        for store in tables.stores.values():
            if store.sparse:
                rows = torch.randperm(store.weight.shape[0])[:5].sort().values
                store.row_gradients.add(rows, torch.randn(5, store.weight.shape[1]))
            else:
                store.main_grad.copy_(torch.randn_like(store.main_grad))
        tables.step()
        tables.zero_grad()
    return tables


def test_tables_and_their_state_come_back_exactly(tmp_path, process_group):
    from fe_megatron.megatron.table_checkpoint import load_tables, save_tables

    saved = trained("adamw", seed=1)
    save_tables(str(tmp_path), saved)
    resumed = stage_tables("adamw", seed=2)  # other values everywhere
    load_tables(str(tmp_path), resumed)
    assert resumed.steps == saved.steps == 2
    for name, store in saved.stores.items():
        other = resumed.stores[name]
        assert torch.equal(other.weight, store.weight)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed.optimizer.state[other.weight][key], saved.optimizer.state[store.weight][key])


def test_a_checkpoint_of_another_update_rule_is_refused_naming_the_missing_state(tmp_path, process_group):
    from fe_megatron.megatron.table_checkpoint import load_tables, save_tables

    save_tables(str(tmp_path), trained("adamw", seed=1))
    with pytest.raises(CheckpointError, match=r"fe_tables: holds no optimizer\.state\.row_momentum\.decoder\.layers\."
                                              r"\d+\.memory\.tables\.weight \(2 of this run's table tensors are "
                                              r"missing\); it was saved by a run with other memory layers or another "
                                              r"optimizer\.table_update: resume with the settings it was saved with"):
        load_tables(str(tmp_path), stage_tables("rowwise_adagrad", seed=2))
