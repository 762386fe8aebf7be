"""The table plan is the one input: change a rule's entry in the registry (`fe_megatron.tables.update_rules`)
and every reader of the plan follows, with no edit of its own.  Each case below reads the plan through one
reader, once with the registry as shipped and once with ``adamw``'s entry changed to a sparse rule with
per-row state (partial row-wise Adam's class); a reader that decided anything from its own copy of the rule
fails its case."""

import pytest

from fe_megatron.tables import update_rules
from fe_megatron.tables.plan import TablePlan
from fe_megatron.tables.sparse_update import PartialRowwiseAdam
from fe_megatron.training.config import OptimizerArgs

WIDTH = 16
CHANGED = update_rules.UpdateRule("adamw", PartialRowwiseAdam, sparse=True, state_words="the changed rule's state")


def expected(rule) -> dict:
    """What every reader must say about ``adamw`` when its entry is ``rule``."""
    return {"sparse": rule.sparse, "state_bytes": rule.state_bytes_per_parameter(WIDTH, "fp32"),
            "words": rule.describe_state("fp32"), "optimizer": rule.optimizer, "layout": rule.state_layout,
            "loads_lazy_adam": rule.state_layout == update_rules.update_rule("lazy_adam").state_layout}


def read_plan() -> dict:
    plan = TablePlan.resolve(update="adamw")
    return {"sparse": plan.in_stores and plan.sparse and plan.gradient_bytes_per_parameter() == 0,
            "state_bytes": plan.state_bytes_per_parameter(WIDTH)}


def read_fe_plan() -> dict:
    """fe-plan's rank memory (`fe_megatron.planning.rank_memory.TableStorage`)."""
    from fe_megatron.planning.rank_memory import TableStorage

    storage = TableStorage(update="adamw")
    return {"sparse": storage.in_stores("fp32"), "words": storage.describe_state(),
            "state_bytes": storage.bytes_per_parameter(WIDTH) - 4 - (0 if storage.in_stores("fp32") else 4)}


def read_stage_tables() -> dict:
    """The owner both engines build from the plan (`StageTables`)."""
    from fe_megatron.memory import FactorEngram
    from fe_megatron.tables.stage_tables import StageTables
    from tests.helpers.configs import small_config

    config = small_config()
    branch = FactorEngram(config, layer_index=config.layers[0])
    tables = StageTables({"b": branch}, OptimizerArgs(), TablePlan.resolve(update="adamw"))
    store = tables.stores["b.tables.weight"]
    tables.optimizer.initialize_state()
    state = tables.optimizer.state[store.weight]
    return {"sparse": store.row_gradients is not None and store.main_grad is None,
            "optimizer": type(tables.optimizer),
            "layout": tuple((key, state[key].dim() == 1) for key in tables.optimizer.state_keys)}


def read_resume_guard() -> dict:
    """Whether a checkpoint's optimizer state carries over (`fe_megatron.checkpoint.resume_guard.compare`):
    lazy_adam keeps two moments per parameter, as the shipped adamw does."""
    from fe_megatron.checkpoint.resume_guard import compare

    def info(rule):
        return {"config": {"memory": {"layers": [1]}, "optimizer": {"table_update": rule}}}

    return {"loads_lazy_adam": compare(info("lazy_adam"), info("adamw"))[0] == []}


def read_deepspeed_guard() -> dict:
    """The DeepSpeed engine's resume guard and converter read a saved run's mode through the plan."""
    saved = {"config": {"memory": {"layers": [1]}, "optimizer": {"table_update": "adamw"}},
             "layout": {"engine": "deepspeed", "table_sharding": "replicated"}}
    return {"sparse": TablePlan.saved_mode(saved) == "replicated"}  # whole tables in stores, not ZeRO's


def read_megatron_lm() -> dict:
    """The Megatron-LM trainer's plan (`fe_megatron.megatron_lm.run.table_plan_of`)."""
    from fe_megatron.megatron_lm.run import table_plan_of

    from fe_megatron.training.config import TrainConfig
    from tests.helpers.configs import small_config

    memory = small_config()
    plan = table_plan_of(TrainConfig(model=memory.backbone, memory=memory))
    return {"sparse": plan.in_stores and plan.sparse, "state_bytes": plan.state_bytes_per_parameter(WIDTH)}


def read_model_guard() -> dict:
    """The guard of a Megatron-LM model built without its tables in stores
    (`fe_megatron.megatron.table_optimizer.refuse_tables_left_to_ddp`): it refuses where the plan keeps them there."""
    from fe_megatron.megatron.table_optimizer import refuse_tables_left_to_ddp
    from tests.helpers.configs import small_config

    try:
        refuse_tables_left_to_ddp(small_config(), "replicated", "FactorEngramGPTModelConfig")
    except ValueError as error:
        return {"sparse": "optimizer.table_update=adamw" in str(error)}
    return {"sparse": False}


READERS = [read_plan, read_fe_plan, read_stage_tables, read_resume_guard, read_deepspeed_guard, read_megatron_lm,
           read_model_guard]


@pytest.mark.parametrize("reader", READERS, ids=lambda reader: reader.__name__)
def test_every_reader_follows_a_rule_changed_in_the_registry(reader, monkeypatch):
    shipped = reader()
    want = expected(update_rules.update_rule("adamw"))
    assert shipped == {key: want[key] for key in shipped}
    monkeypatch.setitem(update_rules.RULES, "adamw", CHANGED)
    changed = reader()
    want = expected(CHANGED)
    assert changed == {key: want[key] for key in changed}
    assert changed != shipped  # the reader saw the change


def test_the_changed_rule_differs_in_everything_the_readers_report():
    assert all(value != expected(CHANGED)[key] for key, value in expected(update_rules.RULES["adamw"]).items())
