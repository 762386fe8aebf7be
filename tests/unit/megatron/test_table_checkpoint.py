"""`fe_megatron.megatron.table_checkpoint`, the one table writer, in one process: a stage's tables and their
optimizer state come back from ``fe_tables/`` exactly (also from ``fe_tables/`` as Megatron-FSDP runs wrote it
before the one writer), a folder without ``fe_tables/`` or without this run's tensors is refused by name, and
the Megatron engine's description of the table optimizer's state (`TableOptimizer.sharded_state_dict`) is
``fe_tables/``'s, piece for piece. Across ranks, layouts and engines: tests/integration/test_deepspeed.py."""

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


def test_a_folder_without_fe_tables_is_refused_naming_it(tmp_path, process_group):
    from fe_megatron.megatron.table_checkpoint import load_tables

    with pytest.raises(CheckpointError, match=rf"{tmp_path}: no fe_tables/ holding the memory tables .*start without "
                                              r"--load"):
        load_tables(str(tmp_path), stage_tables("adamw", seed=2))


def test_without_the_optimizer_only_the_rows_load(tmp_path, process_group):
    """Megatron-LM's --no-load-optim and --finetune: the rows, not their state nor the step counts."""
    from fe_megatron.megatron.table_checkpoint import load_tables, save_tables

    saved = trained("adamw", seed=1)
    save_tables(str(tmp_path), saved)
    resumed = stage_tables("adamw", seed=2)
    resumed.optimizer.initialize_state()
    load_tables(str(tmp_path), resumed, with_optimizer=False)
    assert resumed.steps == 0
    for name, store in saved.stores.items():
        other = resumed.stores[name]
        assert torch.equal(other.weight, store.weight)
        assert not resumed.optimizer.state[other.weight]["exp_avg"].any()


def fsdp_era_state(tables) -> dict:
    """``tables`` as Megatron-FSDP runs wrote ``fe_tables/`` before the one writer: the model's tables
    (megatron-core's regular-grid ShardedTensors) and the table optimizer's state dict, whose parameter
    groups (without their parameters) and step count (``common_step``; no table's own) are the common part."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    model, state = {}, {}
    for index, store in enumerate(tables.stores.values()):
        name = f"decoder.layers.{store.layout.table}.memory.tables.weight"
        model[name] = ShardedTensor.from_rank_offsets(name, store.weight, replica_id=(0, 0, 0))
        saved = tables.optimizer.state[store.weight]
        state[index] = {key: ShardedTensor.from_rank_offsets(f"optimizer.state.{key}.{name}", saved[key],
                                                             replica_id=(0, 0, 0))
                        for key in ("exp_avg", "exp_avg_sq")}
    state["common_step"] = torch.tensor(float(tables.steps))
    groups = [{"lr": 1e-2, "params": LocalNonpersistentObject(list(range(len(tables.stores))))}]
    return {"model": model, "optimizer": {"param_groups": groups, "state": state}}


def test_fe_tables_of_megatron_fsdp_runs_before_the_one_writer_still_load(tmp_path, process_group, cpu_backend):
    from megatron.core import dist_checkpointing

    from fe_megatron.megatron.table_checkpoint import load_tables

    saved = trained("adamw", seed=1)
    (tmp_path / "fe_tables").mkdir()
    dist_checkpointing.save(fsdp_era_state(saved), str(tmp_path / "fe_tables"))
    resumed = stage_tables("adamw", seed=2)
    load_tables(str(tmp_path), resumed)
    assert resumed.steps == saved.steps == 2
    for name, store in saved.stores.items():
        other = resumed.stores[name]
        assert torch.equal(other.weight, store.weight)
        for key in ("exp_avg", "exp_avg_sq", "step"):  # each table's step count: the common one
            assert torch.equal(resumed.optimizer.state[other.weight][key], saved.optimizer.state[store.weight][key])


@pytest.mark.parametrize("update", ["adamw", "rowwise_adagrad"])
def test_the_megatron_engine_describes_the_optimizer_state_as_fe_tables_does(update, process_group, cpu_backend):
    """One description: the table optimizer's sharded state dict (the Megatron engine's and Megatron-LM's
    torch_dist checkpoints) builds, for every state tensor, the pieces ``fe_tables/`` writes: the same keys,
    global shapes and offsets, and the live state's values (per-row state as [rows, 1])."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from fe_megatron.megatron.table_shards import sharded_state_dict

    tables = trained(update, seed=1)
    member = table_member(tables)
    model = {f"decoder.layers.{store.layout.table}.memory.tables.weight": ShardedTensor.from_rank_offsets(
        f"decoder.layers.{store.layout.table}.memory.tables.weight", store.weight) for store in tables.stores.values()}
    megatron = member.sharded_state_dict(model)["state"]
    fe_tables = sharded_state_dict(tables)["optimizer"]
    for index, store in enumerate(tables.stores.values()):
        name = f"decoder.layers.{store.layout.table}.memory.tables.weight"
        assert set(megatron[index]) == set(fe_tables[name])  # each table's step count: common_step
        for key, factory in megatron[index].items():
            built, expected = factory.build(), fe_tables[name][key]
            assert set(built) == set(expected)
            for rows, piece in built.items():
                other = expected[rows]
                assert (piece.key, piece.global_shape, piece.global_offset, piece.replica_id) == \
                    (other.key, other.global_shape, other.global_offset, other.replica_id)
                assert torch.equal(piece.data, other.data)


def table_member(tables):
    """The Megatron engine's chain member over ``tables`` (`TableOptimizer`), with a minimal optimizer config."""
    from megatron.core.optimizer import OptimizerConfig

    from fe_megatron.megatron.table_optimizer import TableOptimizer

    return TableOptimizer(tables, OptimizerConfig(lr=1e-2, min_lr=0.0, clip_grad=1.0))
