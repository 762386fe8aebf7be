"""Per-rank memory of a parallel layout, and the row exchange's bytes, from shapes alone.

What a rank holds (the pipeline stage that holds the most is reported):

* weights: the tables in fp32 (4 bytes per parameter, at every precision); the rest in fp32,
  or bf16 (2 bytes) with ``precision="bf16"``;
* gradients: fp32 (4 bytes), the size of the rank's weights (Megatron's DDP buffers are full
  size, also with the distributed optimizer);
* optimizer: Adam's two fp32 moments (8 bytes), plus an fp32 master copy (4 bytes) of bf16
  weights.  The distributed optimizer splits these over the data-parallel ranks; row-sharded
  tables are split already.

Tensor parallelism splits the tables' columns, the dictionary and the backbone's matrices;
row sharding (``table_sharding="rows"``) splits the tables' rows over the ``dp`` data-parallel
ranks (times the context-parallel ranks, not modelled here).

Row exchange per step (``table_sharding="rows"``): every memory layer sends, per microbatch,
the ids of the rows its positions need (8 bytes each) to their owners and receives the rows
(``s_b / tp`` fp32 values), and in backward sends the rows' fp32 gradients back.  A fraction
``(dp - 1) / dp`` of the rows lives on other ranks.  The figure here is the bound without
deduplication; deduplicating a microbatch's rows first divides it by the duplicate factor
measured on real text (`benchmarks/bench_row_exchange.py`, recorded in benchmarks/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from fe_megatron.config import MemoryConfig
from fe_megatron.memory.sharding import MEGATRON_TABLE_SHARDINGS, ROW_SHARDED
from fe_megatron.planning.budget import layer_params, memory_layer_budget



@dataclass
class RankMemory:
    """Bytes on one rank of the heaviest pipeline stage."""

    table_weights: float
    table_grads: float
    table_optimizer: float
    rest_weights: float
    rest_grads: float
    rest_optimizer: float

    @property
    def tables(self) -> float:
        return self.table_weights + self.table_grads + self.table_optimizer

    @property
    def rest(self) -> float:
        return self.rest_weights + self.rest_grads + self.rest_optimizer


def _stage_params(config: MemoryConfig, pp: int, stage: int) -> tuple:
    """(table parameters, other parameters) of pipeline stage ``stage`` (layers split evenly)."""
    d, layers = config.hidden_size, config.num_layers
    per_stage = layers // pp
    first, last = stage * per_stage, (stage + 1) * per_stage if stage < pp - 1 else layers
    rest = (last - first) * layer_params(config)
    if stage == 0 or stage == pp - 1:
        rest += config.vocab_size * d  # the embedding, and the tied output layer's copy on the last stage
    if stage == pp - 1:
        rest += d  # final norm
    tables = 0
    for layer in config.layers:
        if first <= layer < last:
            budget = memory_layer_budget(config, layer)
            tables += budget.tables
            rest += sum(budget.dense.values())
    return tables, rest


def rank_memory(config: MemoryConfig, tp: int = 1, pp: int = 1, dp: int = 1, table_sharding: str = "replicated",
                distributed_optimizer: bool = False, precision: str = "bf16") -> RankMemory:
    if table_sharding not in MEGATRON_TABLE_SHARDINGS:
        raise ValueError(f"table_sharding {table_sharding!r} is not one of {MEGATRON_TABLE_SHARDINGS}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision {precision!r} is not one of fp32, bf16")
    if config.num_layers % pp:
        raise ValueError(f"pipeline size {pp} does not divide num_layers={config.num_layers}")
    stages = [_stage_params(config, pp, stage) for stage in range(pp)]
    tables, rest = max(stages, key=lambda s: s[0] * 4 * 4 + s[1] * 4 * 4)
    tables /= tp * (dp if table_sharding == ROW_SHARDED else 1)
    rest /= tp
    rest_bytes = 2 if precision == "bf16" else 4
    rest_optimizer = rest * (8 + (4 if precision == "bf16" else 0))
    table_optimizer = tables * 8
    if distributed_optimizer:
        rest_optimizer /= dp
        if table_sharding == "replicated":
            table_optimizer /= dp
    return RankMemory(table_weights=tables * 4, table_grads=tables * 4, table_optimizer=table_optimizer,
                      rest_weights=rest * rest_bytes, rest_grads=rest * 4, rest_optimizer=rest_optimizer)


def table_storage_choices(config: MemoryConfig, tp: int, pp: int, dp: int, precision: str) -> list:
    """``[(choice, table bytes per rank, rank total)]`` of the heaviest pipeline stage at this
    layout, for every way the tables can be kept: training (fp32 weights, gradients and Adam
    moments) replicated, replicated with the distributed optimizer, or row-sharded over ``dp``;
    bf16 tables row-sharded (the DeepSpeed engine: bf16 weights, fp32 gradients and moments);
    serving (weights only, whole: the Hugging Face model) in fp32, bf16 or fp8 (plus its fp32
    scale per row).  The rest of the model is counted as `rank_memory` counts it: for training with
    the distributed optimizer where the choice has it, for serving its weights alone."""
    choices = []
    for name, sharding, distributed in (("train, replicated", "replicated", False),
                                        ("train, replicated, distributed optimizer", "replicated", True),
                                        (f"train, rows over {dp} ranks", ROW_SHARDED, False)):
        m = rank_memory(config, tp, pp, dp, sharding, distributed, precision)
        choices.append((name, m.tables, m.tables + m.rest))
    # bf16 tables (DeepSpeed engine, rows): 2 bytes of weight, 4 of fp32 gradient, 8 of fp32 moments
    bf16 = m.tables * (2 + 4 + 8) / (4 + 4 + 8)
    choices.append((f"train bf16 tables, rows over {dp} ranks", bf16, bf16 + m.rest))
    whole = rank_memory(config, tp, pp, 1, "replicated", False, precision)
    table_params = whole.table_weights / 4  # this stage's tables, split by tensor parallelism
    rows = table_params / (config.branch_width / tp)
    for dtype, per_param, per_row in (("fp32", 4, 0), ("bf16", 2, 0), ("fp8", 1, 4)):
        table_bytes = table_params * per_param + rows * per_row
        choices.append((f"serve {dtype} (Hugging Face model)", table_bytes, table_bytes + whole.rest_weights))
    return choices


def format_table_storage_choices(config: MemoryConfig, tp: int, pp: int, dp: int, precision: str,
                                 device_gib: float) -> str:
    gib = 2 ** 30
    lines = [f"# the tables' storage choices at TP={tp} PP={pp} DP={dp} (per rank, GiB; 'rank' adds the rest of the "
             f"model, {precision}; fits: within {device_gib:g} GiB, before activations)",
             f"{'':<44}{'tables':>10}{'rank':>10}  fits"]
    for name, tables, total in table_storage_choices(config, tp, pp, dp, precision):
        lines.append(f"{name:<44}{tables / gib:>10.2f}{total / gib:>10.2f}  {'yes' if total <= device_gib * gib else 'no'}")
    lines.append("(bf16 training tables: training.engine=deepspeed with table_sharding rows; tables live in device "
                 "memory: a host tier is not offered yet)")
    return "\n".join(lines)


def exchange_bytes_per_step(config: MemoryConfig, tp: int, pp: int, dp: int, micro_batch_size: int, seq_length: int,
                            global_batch_size: int) -> float:
    """Bytes one rank sends and receives per step for its row exchange, without deduplication."""
    if dp == 1:
        return 0.0
    microbatches = global_batch_size // (micro_batch_size * dp)
    per_stage = config.num_layers // pp
    layers = max(sum(1 for layer in config.layers if stage * per_stage <= layer < (stage + 1) * per_stage)
                 for stage in range(pp))
    positions = micro_batch_size * seq_length * config.num_branches
    width = config.branch_width // tp
    per_position = 8 + 4 * width + 4 * width  # id out, row back, gradient out
    return microbatches * layers * positions * (dp - 1) / dp * per_position


def format_rank_memory(config: MemoryConfig, tp: int, pp: int, dp: int, table_sharding: str,
                       distributed_optimizer: bool, precision: str, micro_batch_size: int, seq_length: int,
                       global_batch_size: int) -> str:
    m = rank_memory(config, tp, pp, dp, table_sharding, distributed_optimizer, precision)
    gib = 2 ** 30
    rest_dtype = "bf16 weights, fp32 gradients and Adam state" if precision == "bf16" else "fp32"
    lines = [f"# per rank: TP={tp} PP={pp} DP={dp}, tables {table_sharding}, {precision}"
             f"{', distributed optimizer' if distributed_optimizer else ''} (the heaviest pipeline stage)",
             f"# counted in: tables fp32 (weights, gradients, Adam's two moments: 16 bytes per parameter); "
             f"rest {rest_dtype}",
             f"{'':<8}{'weights':>10}{'grads':>10}{'optimizer':>11}{'total':>10}  (GiB)",
             f"{'tables':<8}{m.table_weights / gib:>10.2f}{m.table_grads / gib:>10.2f}{m.table_optimizer / gib:>11.2f}"
             f"{m.tables / gib:>10.2f}",
             f"{'rest':<8}{m.rest_weights / gib:>10.2f}{m.rest_grads / gib:>10.2f}{m.rest_optimizer / gib:>11.2f}"
             f"{m.rest / gib:>10.2f}",
             f"rank_bytes={int(m.tables + m.rest)}"]
    if table_sharding == ROW_SHARDED:
        exchange = exchange_bytes_per_step(config, tp, pp, dp, micro_batch_size, seq_length, global_batch_size)
        lines.append(f"row exchange per step and rank: at most {exchange / gib:.2f} GiB (micro-batch "
                     f"{micro_batch_size} x {seq_length} tokens, global batch {global_batch_size}; before "
                     "deduplication, which divides it by the duplicate factor of the text)")
    return "\n".join(lines)
