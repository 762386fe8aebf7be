"""The table plan (`fe_megatron.tables.plan`) decides who trains the tables, as docs/tables.md says, and
counts the state each rule keeps."""

import pytest

from fe_megatron.tables.plan import TablePlan


@pytest.mark.parametrize("settings, engine, trainer, mode", [
    ({}, "megatron", "engine", "parameters"),
    ({"bf16_run": True}, "megatron", "stores", "stores"),
    ({"stage_without_memory": True}, "megatron", "stores", "stores"),
    ({"dtype": "bf16"}, "megatron", "stores", "stores"),
    ({"update": "rowwise_adagrad"}, "megatron", "stores", "stores"),
    ({"update": "lazy_adam", "sharding": "rows"}, "megatron", "stores", "stores"),
    ({"sharding": "rows"}, "megatron", "stores", "stores"),
    ({"expert_parallel": 2}, "megatron", "stores", "stores"),
    ({"sharded_backbone": True}, "megatron", "stores", "stores"),
    ({"one_pass_adamw": True}, "megatron", "stores", "stores"),
    ({}, "deepspeed", "engine", "zero"),
    ({"one_pass_adamw": True}, "deepspeed", "engine", "zero"),
    ({"bf16_run": True, "stage_without_memory": True}, "deepspeed", "engine", "zero"),
    ({"sharding": "zero"}, "deepspeed", "engine", "zero"),
    ({"sharding": "rows"}, "deepspeed", "stores", "rows"),
    ({"placement": "host"}, "deepspeed", "stores", "replicated"),
    ({"update": "lazy_adam"}, "deepspeed", "stores", "replicated"),
    ({"state_dtype": "bf16", "sharding": "rows"}, "deepspeed", "stores", "rows"),
])
def test_the_plan_decides_who_trains_the_tables(settings, engine, trainer, mode):
    plan = TablePlan.resolve(engine, **settings)
    assert (plan.trainer, plan.mode) == (trainer, mode)
    assert bool(plan.reasons) == (trainer == "stores")
    line = plan.describe()
    assert line.startswith("tables ") and ("in stores because of" in line) == plan.in_stores


def test_the_plan_counts_the_state_each_rule_keeps():
    adamw, adagrad, lazy = (TablePlan.resolve(update=u) for u in ("adamw", "rowwise_adagrad", "lazy_adam"))
    assert (adamw.gradient_bytes_per_parameter(), adamw.state_bytes_per_parameter(128)) == (4, 8)
    assert (adagrad.gradient_bytes_per_parameter(), adagrad.state_bytes_per_parameter(128)) == (0, 4 / 128)
    assert (lazy.gradient_bytes_per_parameter(), lazy.state_bytes_per_parameter(128)) == (0, 8)
    with pytest.raises(ValueError, match="'sgd' is not one of"):
        TablePlan.resolve(update="sgd")


@pytest.mark.parametrize("engine, settings, in_model", [
    ("megatron", {}, True),
    ("megatron", {"sharding": "rows"}, True),
    ("megatron", {"sharded_backbone": True}, False),
    ("megatron", {"sharded_backbone": True, "sharding": "rows"}, False),
    ("deepspeed", {"sharding": "rows"}, False),
])
def test_the_plan_says_where_the_tables_are_checkpointed(engine, settings, in_model):
    """Megatron's dist-checkpoint saves the tables with the model, except beside a backbone under
    Megatron-FSDP, whose fsdp_dtensor checkpoint has them beside it (as the DeepSpeed engine's files do)."""
    assert TablePlan.resolve(engine, **settings).tables_in_model_state_dict is in_model


@pytest.mark.parametrize("settings, holder", [
    ({}, "parameter"),
    ({"dtype": "bf16"}, "store"),
    ({"placement": "host"}, "store"),
    ({"sharding": "rows"}, "row_sharded_store"),
    ({"sharding": "node", "placement": "host"}, "row_sharded_store"),
    ({"engine": "deepspeed", "sharding": "zero"}, "parameter"),
])
def test_the_plan_decides_who_holds_the_rows(settings, holder):
    assert TablePlan.resolve(**settings).holder == holder


@pytest.mark.parametrize("placement, recompute, ahead", [
    ("host", "none", True), ("host", "selective", True), ("host", "full", False), ("device", "none", False)])
def test_the_plan_decides_whether_rows_are_fetched_a_microbatch_ahead(placement, recompute, ahead):
    assert TablePlan.resolve(placement=placement, recompute=recompute).lookahead is ahead


def test_the_plan_decides_which_shardings_need_the_row_group_and_what_a_module_holds():
    from fe_megatron.tables.plan import module_holder, shards_rows

    assert [sharding for sharding in ("replicated", "rows", "node", "zero") if shards_rows(sharding)] == ["rows", "node"]
    assert [module_holder(dtype) for dtype in ("fp32", "bf16", "fp8")] == ["parameter", "read_only", "read_only"]


def test_fe_pretrain_trains_whole_adamw_tables_in_one_pass_unless_the_distributed_optimizer_shards_them():
    """fe-pretrain's Megatron engine without the distributed optimizer keeps whole fp32 AdamW tables in stores
    (the table optimizer's one-pass AdamW); with it, and in Megatron-LM's trainer, they stay Megatron's
    parameters (its distributed optimizer shards their moments)."""
    from fe_megatron.training.config import load_train_config
    from tests.helpers.training import CONFIG

    config = load_train_config(CONFIG, ["data.train_data=[unused]"])
    plan = TablePlan.for_run(config, fe_pretrain=True)
    assert plan.mode == "stores" and plan.reasons == ("no distributed optimizer: the table optimizer's one-pass "
                                                      "AdamW",)
    assert TablePlan.for_run(config).mode == "parameters"  # Megatron-LM's trainer
    config.parallel.distributed_optimizer = True
    assert TablePlan.for_run(config, fe_pretrain=True).mode == "parameters"
