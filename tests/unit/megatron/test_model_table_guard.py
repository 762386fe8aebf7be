"""The guard of a Megatron-LM model built without its tables moved into stores
(`fe_megatron.megatron.table_optimizer.refuse_tables_left_to_ddp`, called by `fe_megatron.megatron_lm.model`'s
builders when ``tables_into_stores`` is unset): the table plan decides, and the message names why."""

import pytest

from fe_megatron.megatron.table_optimizer import refuse_tables_left_to_ddp
from tests.helpers.configs import small_config


def test_tables_the_engine_trains_need_no_stores():
    refuse_tables_left_to_ddp(small_config(), "replicated", "FactorEngramGPTModelConfig")


@pytest.mark.parametrize("memory, sharding, why", [
    (dict(), "rows", "row-sharded tables"),
    (dict(table_dtype="bf16"), "replicated", "memory.table_dtype=bf16"),
    (dict(table_placement="host"), "replicated", "memory.table_placement=host"),
])
def test_tables_the_plan_keeps_in_stores_are_refused_naming_why(memory, sharding, why):
    with pytest.raises(ValueError, match=rf"the table plan keeps these tables in stores \({why}\), which must hold "
                                         r"them before DDP wraps the model: set FactorEngramHybridModelConfig\."
                                         r"tables_into_stores"):
        refuse_tables_left_to_ddp(small_config(**memory), sharding, "FactorEngramHybridModelConfig")
