"""Per-rank memory (`fe_megatron.planning.rank_memory`): whole and row-sharded tables, the heaviest
pipeline stage, and what each way of keeping the tables costs where it lives."""

import pytest

from fe_megatron.config import MemoryConfig
from fe_megatron.planning.budget import memory_layer_budget
from fe_megatron.planning.rank_memory import DTYPE_BYTES


def test_rank_memory_of_whole_and_row_sharded_tables():
    from fe_megatron.planning.rank_memory import exchange_bytes_per_step, rank_memory

    c = MemoryConfig.from_preset("factorengram-340m")
    tables = sum(memory_layer_budget(c, layer).tables for layer in c.layers)
    # fp32 runs: the engine's optimizer holds fp32 tables, and its distributed optimizer splits whole tables' moments
    whole = rank_memory(c, dp=8, table_sharding="replicated", distributed_optimizer=True, precision="fp32")
    rows = rank_memory(c, dp=8, table_sharding="rows", distributed_optimizer=True, precision="fp32")
    assert whole.table_weights == whole.table_grads == 4 * tables and whole.table_optimizer == 8 * tables / 8
    assert rows.table_weights == rows.table_grads == 4 * tables / 8 and rows.table_optimizer == 8 * tables / 8
    assert rows.rest == whole.rest and rank_memory(c, tp=2).table_weights == 2 * tables
    # bf16 runs train every table from stores, whose moments the distributed optimizer does not split; so
    # do layouts with a pipeline stage holding no memory layer (at PP=4 stages 1 and 2 hold one of the two
    # layers each, stages 0 and 3 none)
    assert rank_memory(c, dp=8, distributed_optimizer=True, precision="bf16").table_optimizer == 8 * tables
    heaviest_layer = max(memory_layer_budget(c, layer).tables for layer in c.layers)  # primes differ per layer
    assert rank_memory(c, pp=4, dp=8, distributed_optimizer=True, precision="fp32").table_optimizer == \
        8 * heaviest_layer
    # 64 sequences over 8 ranks: 8 microbatches x 2 layers x 8192 x 12 positions, 7/8 of them elsewhere
    assert exchange_bytes_per_step(c, 1, 1, 8, 1, 8192, 64) == 8 * 2 * 8192 * 12 * 7 / 8 * (8 + 8 * 256)
    assert exchange_bytes_per_step(c, 1, 1, 1, 1, 8192, 64) == 0


def test_the_heaviest_stage_is_counted_in_the_tables_storage():
    """With the tables in host memory a stage's device bytes are its other weights; the stage
    reported is the one holding the most bytes in all, which at PP=4 is a stage with a memory layer."""
    from fe_megatron.planning.rank_memory import TableStorage, rank_memory

    c = MemoryConfig.from_preset("factorengram-340m")
    heaviest_layer = max(memory_layer_budget(c, layer).tables for layer in c.layers)
    for storage in (TableStorage(), TableStorage("bf16", "bf16", "host")):
        m = rank_memory(c, pp=4, dp=8, precision="fp32", storage=storage)
        assert m.table_weights == DTYPE_BYTES[storage.table_dtype] * heaviest_layer
        assert m.host == (m.tables if storage.placement == "host" else 0)


@pytest.mark.parametrize("table_dtype,state_dtype,placement,per_parameter", [
    ("fp32", "fp32", "device", 16), ("bf16", "fp32", "device", 14), ("bf16", "bf16", "device", 8),
    ("fp32", "fp32", "host", 16), ("bf16", "bf16", "host", 8)])
def test_each_table_storage_costs_its_bytes_where_it_lives(table_dtype, state_dtype, placement, per_parameter):
    from fe_megatron.planning.rank_memory import TableStorage, rank_memory

    c = MemoryConfig.from_preset("factorengram-340m")
    tables = sum(memory_layer_budget(c, layer).tables for layer in c.layers)
    m = rank_memory(c, tp=2, dp=8, table_sharding="rows", storage=TableStorage(table_dtype, state_dtype, placement))
    assert m.tables == per_parameter * tables / 2 / 8
    assert (m.host, m.device) == ((m.tables, m.rest) if placement == "host" else (0, m.tables + m.rest))


def test_table_storage_choices_count_every_way_of_keeping_the_tables():
    from fe_megatron.planning.rank_memory import table_storage_choices

    c = MemoryConfig.from_preset("factorengram-340m")
    tables = sum(memory_layer_budget(c, layer).tables for layer in c.layers)
    rows = tables / c.branch_width  # at TP=2 each rank holds half of every row, and each row's fp8 scale
    got = {(x.use, x.table_dtype, x.state_dtype, x.placement, x.update, x.sharding): x.tables
           for x in table_storage_choices(c, 2, 1, 8, "bf16")}
    rowwise = 2 + 4 / (c.branch_width / 2)  # bf16 rows, no dense gradient, one fp32 state per (half) row
    train = {tuple(key): per_parameter * tables / 2 for *key, per_parameter in (
        ("fp32", "fp32", "device", "adamw", 16), ("bf16", "fp32", "device", "adamw", 14),
        ("bf16", "bf16", "device", "adamw", 8), ("fp32", "fp32", "host", "adamw", 16),
        ("bf16", "bf16", "host", "adamw", 8), ("bf16", "fp32", "device", "rowwise_adagrad", rowwise),
        ("bf16", "fp32", "host", "rowwise_adagrad", rowwise))}
    expected = {("train", *key, "whole"): value for key, value in train.items()}
    expected.update({("train", *key, "rows"): value / 8 for key, value in train.items()})
    expected.update({("serve", "fp32", "-", "device", "-", "whole"): 4 * tables / 2,
                     ("serve", "bf16", "-", "device", "-", "whole"): 2 * tables / 2,
                     ("serve", "fp8", "-", "device", "-", "whole"): tables / 2 + 4 * rows})
    assert got == expected
