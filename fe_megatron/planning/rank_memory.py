"""Per-rank memory of a parallel layout, and the row exchange's bytes, from shapes alone.

What a rank holds (the pipeline stage that holds the most bytes, device and host together, is
reported):

* the tables: weights, gradients and Adam's two moments.  Held by the engine's optimizer (fp32
  tables and state, device memory, fp32 precision) that is 4 + 4 + 8 = 16 bytes per parameter,
  with the moments of whole tables split over the data-parallel ranks by the distributed
  optimizer.  In table stores (`fe_megatron.tables.stage_tables`: bf16 tables, bf16 state, the
  host tier, every bf16 run, and every run with a pipeline stage that holds no memory layer) it
  is the table dtype's bytes + the state dtype's for the gradient and each moment: 16 (fp32, fp32
  state), 14 (bf16 tables), 8 (bf16 tables and bf16 state), and the distributed optimizer does
  not split the moments; with the host tier all of it is in host memory, none on the device;
* the rest: weights in fp32, or bf16 (2 bytes) with ``precision="bf16"``; fp32 gradients
  (4 bytes: Megatron's DDP buffers are full size, also with the distributed optimizer); Adam's two
  fp32 moments (8 bytes) plus an fp32 master copy (4 bytes) of bf16 weights, split over the
  data-parallel ranks by the distributed optimizer.

Tensor parallelism splits the tables' columns, the dictionary and the backbone's matrices;
row sharding (``table_sharding="rows"``) splits the tables' rows over the ``dp`` data-parallel
ranks (times the context-parallel ranks, not modelled here).

Row exchange per step (``table_sharding="rows"``): every memory layer sends, per microbatch,
the ids of the rows its positions need (8 bytes each) to their owners and receives the rows
(``s_b / tp`` values of the table dtype), and in backward sends the rows' fp32 gradients back.  A
fraction ``(dp - 1) / dp`` of the rows lives on other ranks.  The figure here is the bound without
deduplication; deduplicating a microbatch's rows first divides it by the duplicate factor
measured on real text (`benchmarks/bench_row_exchange.py`, recorded in benchmarks/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from fe_megatron.config import MemoryConfig
from fe_megatron.tables.plan import DTYPE_BYTES, TablePlan
from fe_megatron.tables.update_rules import update_rule
from fe_megatron.memory.sharding import (MEGATRON_TABLE_SHARDINGS, ROW_SHARDED, ROW_SHARDINGS, pipeline_stage_layers,
                                         stages_without_memory)
from fe_megatron.planning.budget import layer_params, memory_layer_budget



@dataclass
class RankMemory:
    """Bytes on one rank of the heaviest pipeline stage (``table_*`` wherever the tables are:
    ``tables_on_host`` says where)."""

    table_weights: float
    table_grads: float
    table_optimizer: float
    rest_weights: float
    rest_grads: float
    rest_optimizer: float
    tables_on_host: bool = False

    @property
    def tables(self) -> float:
        return self.table_weights + self.table_grads + self.table_optimizer

    @property
    def rest(self) -> float:
        return self.rest_weights + self.rest_grads + self.rest_optimizer

    @property
    def device(self) -> float:
        return self.rest + (0 if self.tables_on_host else self.tables)

    @property
    def host(self) -> float:
        return self.tables if self.tables_on_host else 0


@dataclass(frozen=True)
class TableStorage:
    """How the tables are kept while training (docs/tables.md)."""

    table_dtype: str = "fp32"
    state_dtype: str = "fp32"  # optimizer.table_state_dtype: the gradient and the two moments
    placement: str = "device"
    update: str = "adamw"  # optimizer.table_update

    def plan(self, precision: str, stage_without_memory: bool = False,
             table_sharding: str = "replicated") -> TablePlan:
        """The Megatron engine's `TablePlan` for this storage (who trains the tables, what state they keep)."""
        return TablePlan.resolve("megatron", self.table_dtype, self.state_dtype, self.placement, table_sharding,
                                 self.update, precision == "bf16", stage_without_memory)

    def in_stores(self, precision: str, stage_without_memory: bool = False) -> bool:
        """Trained by fe_megatron's table optimizer (`TablePlan.in_stores`)."""
        return self.plan(precision, stage_without_memory).in_stores

    def describe_state(self) -> str:
        return update_rule(self.update).describe_state(self.state_dtype)

    def bytes_per_parameter(self, width: int = 128) -> float:
        """Weight, gradient and optimizer state per table parameter (rows of ``width`` columns on a rank)."""
        plan = self.plan("fp32")
        return (DTYPE_BYTES[self.table_dtype] + plan.gradient_bytes_per_parameter()
                + plan.state_bytes_per_parameter(width))


def _stage_params(config: MemoryConfig, pp: int, stage: int) -> tuple:
    """(table parameters, other parameters) of pipeline stage ``stage``."""
    d, layers = config.hidden_size, pipeline_stage_layers(config.num_layers, pp, stage)
    rest = len(layers) * layer_params(config)
    if stage == 0 or stage == pp - 1:
        rest += config.vocab_size * d  # the embedding, and the tied output layer's copy on the last stage
    if stage == pp - 1:
        rest += d  # final norm
    tables = 0
    for layer in config.layers:
        if layer in layers:
            budget = memory_layer_budget(config, layer)
            tables += budget.tables
            rest += sum(budget.dense.values())
    return tables, rest


def rank_memory(config: MemoryConfig, tp: int = 1, pp: int = 1, dp: int = 1, table_sharding: str = "replicated",
                distributed_optimizer: bool = False, precision: str = "bf16",
                storage: TableStorage = TableStorage()) -> RankMemory:
    if table_sharding not in MEGATRON_TABLE_SHARDINGS:
        raise ValueError(f"table_sharding {table_sharding!r} is not one of {MEGATRON_TABLE_SHARDINGS}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision {precision!r} is not one of fp32, bf16")
    if table_sharding == "node" and storage.placement != "host":
        raise ValueError("table_sharding 'node' keeps the tables in host memory: estimate it with that placement "
                         "(fe-plan --table-placement host; memory.table_placement: host)")
    if config.num_layers % pp:
        raise ValueError(f"pipeline size {pp} does not divide num_layers={config.num_layers}")
    if config.backbone.num_experts:
        raise ValueError(f"model.num_experts={config.backbone.num_experts}: the per-rank estimates are for a dense "
                         "backbone (they do not split experts over expert-parallel ranks); fe_megatron.planning.budget "
                         "counts the experts' parameters")
    plan = storage.plan(precision, bool(stages_without_memory(config.layers, config.num_layers, pp)), table_sharding)
    split_table_moments = distributed_optimizer and table_sharding == "replicated" and not plan.in_stores
    gradient, state = plan.gradient_bytes_per_parameter(), plan.state_bytes_per_parameter(config.branch_width // tp)
    rest_bytes = 2 if precision == "bf16" else 4

    def stage_memory(stage: int) -> RankMemory:
        tables, rest = _stage_params(config, pp, stage)
        tables /= tp * (dp if table_sharding in ROW_SHARDINGS else 1)
        rest /= tp
        rest_optimizer = rest * (8 + (4 if precision == "bf16" else 0))
        return RankMemory(table_weights=tables * DTYPE_BYTES[storage.table_dtype], table_grads=tables * gradient,
                          table_optimizer=tables * state / (dp if split_table_moments else 1),
                          rest_weights=rest * rest_bytes, rest_grads=rest * 4,
                          rest_optimizer=rest_optimizer / (dp if distributed_optimizer else 1),
                          tables_on_host=storage.placement == "host")

    return max((stage_memory(stage) for stage in range(pp)), key=lambda m: m.tables + m.rest)


TRAINING_STORAGES = (TableStorage(), TableStorage("bf16"), TableStorage("bf16", "bf16"),
                     TableStorage(placement="host"), TableStorage("bf16", "bf16", "host"),
                     TableStorage("bf16", update="rowwise_adagrad"), TableStorage("bf16", placement="host",
                                                                                  update="rowwise_adagrad"))


@dataclass(frozen=True)
class StorageChoice:
    """One way of keeping the tables, and what it costs one rank (bytes)."""

    use: str  # train | serve
    table_dtype: str
    state_dtype: str  # the gradient and Adam's moments ("-" when serving)
    placement: str
    update: str  # optimizer.table_update ("-" when serving)
    sharding: str  # whole | rows
    bytes_per_parameter: float
    tables: float
    device: float  # tables on the device plus the rest of the model
    host: float


def table_storage_choices(config: MemoryConfig, tp: int, pp: int, dp: int, precision: str,
                          distributed_optimizer: bool = False) -> list:
    """`StorageChoice` s of the heaviest pipeline stage at this layout, for every way the tables can
    be kept: training (`TRAINING_STORAGES`, whole or row-sharded over ``dp``) and serving (weights
    only, whole: the Hugging Face model) in fp32, bf16 or fp8 (plus its fp32 scale per row).  The
    rest of the model is counted on the device as `rank_memory` counts it, for serving its weights alone."""
    choices = []
    for sharding in ("replicated", ROW_SHARDED):
        for storage in TRAINING_STORAGES:
            m = rank_memory(config, tp, pp, dp, sharding, distributed_optimizer, precision, storage)
            choices.append(StorageChoice("train", storage.table_dtype, storage.state_dtype, storage.placement,
                                         storage.update, "whole" if sharding == "replicated" else "rows",
                                         m.tables / (m.table_weights / DTYPE_BYTES[storage.table_dtype])
                                         if m.table_weights else storage.bytes_per_parameter(config.branch_width // tp),
                                         m.tables, m.device, m.host))
    whole = rank_memory(config, tp, pp, 1, "replicated", False, precision)
    table_params = whole.table_weights / 4  # this stage's tables, split by tensor parallelism
    rows = table_params / (config.branch_width / tp)
    for dtype, per_param, per_row in (("fp32", 4, 0), ("bf16", 2, 0), ("fp8", 1, 4)):
        table_bytes = table_params * per_param + rows * per_row
        choices.append(StorageChoice("serve", dtype, "-", "device", "-", "whole", table_bytes / table_params,
                                     table_bytes, table_bytes + whole.rest_weights, 0.0))
    return choices


def format_table_storage_choices(config: MemoryConfig, tp: int, pp: int, dp: int, precision: str,
                                 device_gib: float, distributed_optimizer: bool = False, host_gib: float = 1024.0,
                                 ranks_per_node: int = 8) -> str:
    gib = 2 ** 30
    lines = [f"# the tables' storage choices at TP={tp} PP={pp} DP={dp}, the rest of the model in {precision} (per "
             f"rank, GiB{', the heaviest pipeline stage' if pp > 1 else ''}).  dtype: the tables' (memory.table_dtype); state: their "
             "gradient and Adam's two moments (optimizer.table_state_dtype); update: optimizer.table_update (the "
             "sparse rules keep no dense gradient; rowwise_adagrad one fp32 state per row); B/p: bytes per table "
             "parameter; "
             "'device' adds the rest of the model; 'host': the host tier's share of one rank; fits: the device "
             f"within {device_gib:g} GiB (before activations) and {ranks_per_node} ranks' host shares within a node's "
             f"{host_gib:g} GiB",
             f"{'':<6}{'dtype':<6}{'state':<6}{'placement':<10}{'update':<16}{'sharding':<10}{'B/p':>5}{'tables':>9}"
             f"{'device':>9}"
             f"{'host':>9}  fits"]
    for c in table_storage_choices(config, tp, pp, dp, precision, distributed_optimizer):
        sharding = c.sharding if c.sharding == "whole" else f"rows/{dp}"
        fits = c.device <= device_gib * gib and c.host * ranks_per_node <= host_gib * gib
        lines.append(f"{c.use:<6}{c.table_dtype:<6}{c.state_dtype:<6}{c.placement:<10}{c.update:<16}{sharding:<10}"
                     f"{c.bytes_per_parameter:>5.1f}{c.tables / gib:>9.2f}{c.device / gib:>9.2f}{c.host / gib:>9.2f}  "
                     f"{'yes' if fits else 'no'}")
    lines.append("(train with memory.table_dtype, optimizer.table_state_dtype, memory.table_placement, "
                 "optimizer.table_update and parallel.table_sharding; serve with fe-convert --table-dtype; "
                 "docs/tables.md)")
    return "\n".join(lines)


def exchange_bytes_per_step(config: MemoryConfig, tp: int, pp: int, dp: int, micro_batch_size: int, seq_length: int,
                            global_batch_size: int) -> float:
    """Bytes one rank sends and receives per step for its row exchange, without deduplication."""
    if dp == 1:
        return 0.0
    microbatches = global_batch_size // (micro_batch_size * dp)
    layers = max(sum(1 for layer in config.layers if layer in pipeline_stage_layers(config.num_layers, pp, stage))
                 for stage in range(pp))
    positions = micro_batch_size * seq_length * config.num_branches
    width = config.branch_width // tp
    per_position = 8 + DTYPE_BYTES[config.table_dtype] * width + 4 * width  # id out, row back, gradient out
    return microbatches * layers * positions * (dp - 1) / dp * per_position


def format_rank_memory(config: MemoryConfig, tp: int, pp: int, dp: int, table_sharding: str,
                       distributed_optimizer: bool, precision: str, micro_batch_size: int, seq_length: int,
                       global_batch_size: int, storage: TableStorage = TableStorage(), ranks_per_node: int = 8) -> str:
    m = rank_memory(config, tp, pp, dp, table_sharding, distributed_optimizer, precision, storage)
    gib = 2 ** 30
    rest_dtype = "bf16 weights, fp32 gradients and Adam state" if precision == "bf16" else "fp32"
    lines = [f"# per rank: TP={tp} PP={pp} DP={dp}, tables {table_sharding}, the rest of the model in {precision}"
             f"{', distributed optimizer' if distributed_optimizer else ''}"
             f"{' (the heaviest pipeline stage)' if pp > 1 else ''}",
             f"# counted in: tables {storage.table_dtype} weights, {storage.describe_state()} "
             f"({storage.bytes_per_parameter(config.branch_width // tp):g} bytes per parameter), in "
             f"{storage.placement} memory; rest {rest_dtype}",
             f"{'':<8}{'weights':>10}{'grads':>10}{'optimizer':>11}{'total':>10}  (GiB)",
             f"{'tables':<8}{m.table_weights / gib:>10.2f}{m.table_grads / gib:>10.2f}{m.table_optimizer / gib:>11.2f}"
             f"{m.tables / gib:>10.2f}{'  (host)' if m.tables_on_host else ''}",
             f"{'rest':<8}{m.rest_weights / gib:>10.2f}{m.rest_grads / gib:>10.2f}{m.rest_optimizer / gib:>11.2f}"
             f"{m.rest / gib:>10.2f}",
             f"rank_bytes={int(m.tables + m.rest)} (device {int(m.device)}, host {int(m.host)})"]
    stage_without_memory = bool(stages_without_memory(config.layers, config.num_layers, pp))
    if distributed_optimizer and table_sharding == "replicated" and storage.in_stores(precision, stage_without_memory):
        why = storage.plan(precision, stage_without_memory).reasons
        lines.append(f"the tables' Adam moments are not split over DP: the tables train from stores ({', '.join(why)}),"
                     " which the distributed optimizer does not shard (docs/tables.md)")
    if table_sharding == "node":
        segment = m.table_weights * min(ranks_per_node, tp * pp * dp) / gib
        lines.append(f"node-shared tables: the table weights above are this rank's slice of its node's segment in "
                     f"shared memory (/dev/shm), which holds the node's ranks' slices once: about {segment:.2f} GiB "
                     f"with {ranks_per_node} ranks per node (--ranks-per-node), which that folder needs free")
    if table_sharding in ROW_SHARDINGS:
        exchange = exchange_bytes_per_step(config, tp, pp, dp, micro_batch_size, seq_length, global_batch_size)
        lines.append(f"row exchange per step and rank: at most {exchange / gib:.2f} GiB (micro-batch "
                     f"{micro_batch_size} x {seq_length} tokens, global batch {global_batch_size}; before "
                     "deduplication, which divides it by the duplicate factor of the text)")
    return "\n".join(lines)
