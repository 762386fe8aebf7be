"""`fe_megatron.deepspeed.tables`: tables outside ZeRO, in one process, clipped by the norm they are given."""

import pytest
import torch

from fe_megatron.training.config import load_train_config
from tests.helpers.deepspeed import overrides
from tests.helpers.training import CONFIG

pytest.importorskip("deepspeed", reason="DeepSpeed is installed by the project's set-up (make setup)")


def test_tables_outside_zero_are_clipped_by_the_norm_of_every_gradient(small_data, tmp_path):
    """Under table_sharding=rows the tables' gradients are averaged over the ranks and clipped by the
    norm they are given (the joint norm of ZeRO's parameters and theirs, `JointClipping`), or by
    their own when none is."""
    import torch.distributed as dist

    from fe_megatron.deepspeed.engine import build_model
    from fe_megatron.deepspeed.tables import StoredTables
    from fe_megatron.tables.plan import TablePlan

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        cfg = load_train_config(CONFIG, overrides(small_data, **{"training.engine": "deepspeed",
                                                                 "parallel.table_sharding": "rows",
                                                                 "optimizer.clip_grad": 0.5,
                                                                 "optimizer.weight_decay": 0.0}))
        model = build_model(cfg, dist.group.WORLD)
        tables = StoredTables(model, cfg.optimizer, TablePlan.for_run(cfg))
        assert not any(name.endswith("tables.weight") for name, _ in model.named_parameters())  # outside ZeRO
        assert not any(name.endswith("tables.weight") for name in model.state_dict())  # ZeRO saves none either
        stores = tables.tables.stores
        for group in tables.optimizer.param_groups:
            group["lr"] = 1e-3
        for given in (None, 3.0):  # their own norm; a joint norm above it
            grads = {name: torch.randn_like(store.weight) for name, store in stores.items()}
            before = {name: store.weight.clone() for name, store in stores.items()}
            moments = {name: tables.optimizer.state[store.weight]["exp_avg"].clone()
                       if store.weight in tables.optimizer.state else torch.zeros_like(store.weight)
                       for name, store in stores.items()}
            for name, store in stores.items():
                store.main_grad.copy_(grads[name])
            own = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
            if given is not None:
                given = own * given
            norm = tables.step(given)
            assert norm == pytest.approx(own if given is None else given, rel=1e-9)
            assert [name for name, store in stores.items() if not torch.equal(store.weight, before[name])] == \
                list(stores)
            for name, store in stores.items():  # AdamW saw the gradient clipped by that norm
                clipped = grads[name] * (0.5 / (norm + 1e-6))
                torch.testing.assert_close(tables.optimizer.state[store.weight]["exp_avg"],
                                           0.9 * moments[name] + 0.1 * clipped, rtol=1e-5, atol=1e-9)
                assert not store.main_grad.any()  # zeroed for the next step
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_resumes_only_in_the_table_mode_that_wrote_it(tmp_path):
    """The DeepSpeed resume guard reads both modes from the plan: the saved run's (its run info) and this
    run's; a run saved before run infos recorded the mode is read from its config.  Outside ZeRO, whole
    and row-sharded tables load each other's checkpoints by global row (``fe_tables/``), not the per-rank
    files written before those."""
    from fe_megatron.checkpoint.files import CheckpointError
    from fe_megatron.deepspeed.engine import refuse_table_mode_change
    from fe_megatron.tables.plan import TablePlan

    old = {"config": {"memory": {"layers": [1], "table_dtype": "fp32"}, "optimizer": {}},
           "layout": {"engine": "deepspeed", "table_sharding": "zero"}}
    assert TablePlan.saved_mode(old) == "zero"
    refuse_table_mode_change("ckpt", old, TablePlan.resolve("deepspeed", sharding="replicated"))  # fp32: ZeRO's too
    with pytest.raises(CheckpointError, match=r"ckpt was saved with its tables as ZeRO parameters .*, and this run "
                                              r"keeps them row-sharded outside ZeRO .*parallel.table_sharding=zero"):
        refuse_table_mode_change("ckpt", old, TablePlan.resolve("deepspeed", sharding="rows"))
    recorded = dict(old, tables="rows")
    refuse_table_mode_change("ckpt", recorded, TablePlan.resolve("deepspeed", sharding="rows"))
    refuse_table_mode_change("ckpt", {"config": {"memory": None}}, TablePlan.resolve("deepspeed", sharding="rows"))
    whole, rows = TablePlan.resolve("deepspeed", sharding="replicated", dtype="bf16"), \
        TablePlan.resolve("deepspeed", sharding="rows", dtype="bf16")
    assert (whole.mode, rows.mode) == ("replicated", "rows")
    by_global_row = tmp_path / "by_global_row"
    (by_global_row / "fe_tables").mkdir(parents=True)
    (by_global_row / "fe_tables" / "metadata.json").write_text("{}")
    for saved, now in ((rows, whole), (whole, rows)):
        refuse_table_mode_change(str(by_global_row), dict(old, tables=saved.mode), now)
        with pytest.raises(CheckpointError, match="resume with the table settings it was saved with"):
            refuse_table_mode_change(str(tmp_path / "rank_files"), dict(old, tables=saved.mode), now)
    with pytest.raises(CheckpointError, match="as ZeRO parameters"):  # ZeRO's own files hold them
        refuse_table_mode_change(str(by_global_row), dict(old, tables="rows"), TablePlan.resolve("deepspeed"))
