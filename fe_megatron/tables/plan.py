"""TablePlan: how a run keeps and trains its tables, decided once.

A run's tables can be kept and trained several ways: fp32 or bf16 rows, fp32 or bf16 optimizer
state, on the device or in host memory, whole or row-sharded, updated by AdamW over every row
or by a sparse rule over the touched rows.  Three mechanisms train them: the Megatron engine's
optimizer (the tables as its parameters), ZeRO (the DeepSpeed engine's parameters), or fe_megatron's
own table optimizer over `fe_megatron.tables.store.TableStore`s (`fe_megatron.tables.stage_tables.StageTables`).
`TablePlan.resolve` is the one place that decides which, from the configuration and the parallel
layout; both engines, the resume guards and ``fe-plan`` read its answer, and a run prints it at
start-up (`describe`).

The rules (docs/tables.md, "Who trains the tables"):

* whole fp32 tables with fp32 state on the device, updated by AdamW, are the engine's parameters:
  Megatron's optimizer (its distributed optimizer then shards their moments), or ZeRO's (DeepSpeed,
  ``table_sharding`` ``replicated`` or ``zero``); except in fe-pretrain's Megatron engine without the
  distributed optimizer (``one_pass_adamw``), where Megatron's optimizer would shard nothing and its DDP
  reduces the gradients at the step's end, as the stores do: there the table optimizer trains them, its
  AdamW one pass over each row (`fe_megatron.ops.table_adamw_`) where Megatron's Adam makes several over
  every tensor (benchmarks/RESULTS.md: 0.93 of the matmul bound against 0.88). Both save the tables and their
  moments under the same names (`fe_megatron.megatron.table_optimizer.refuse_table_optimizer_change`), so
  a checkpoint of either resumes in the other;
* anything else lives in stores and is trained by the table optimizer: bf16 rows, bf16 state, the
  host tier, a sparse update (only the table optimizer keeps gradients by row), and row-sharded
  tables in both engines: their rows are sharded over the tables' own row group (every data-parallel
  rank), which neither Megatron's data-parallel buffers nor ZeRO know;
* under Megatron also every table of a bf16 run (its mixed-precision optimizer would keep the
  tables as bf16 weights with fp32 copies, 18 bytes per parameter), of an expert-parallel MoE
  backbone (Megatron reduces the parameters it does not all-reduce over the expert-data-parallel
  ranks, a part of the data-parallel ones), and of a pipeline layout with a stage that holds no
  memory layer (every stage must build the same optimizer chain, which a checkpoint's common part,
  written by global rank 0, describes for all);
* and every table beside a backbone under Megatron-FSDP (``sharded_backbone``: Megatron-LM's
  ``--use-megatron-fsdp``), which would shard the tables' columns with the backbone's parameters
  and take them for expert parameters; the stores keep them whole or row-sharded outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fe_megatron.tables.optimizer import DTYPE_BYTES
from fe_megatron.tables.update_rules import UpdateRule, update_rule

ENGINE, STORES = "engine", "stores"
# Who holds a table's rows (`fe_megatron.tables.holders`): a parameter of the module (trained by the engine's
# optimizer), read-only serving rows of the module, a `TableStore`, or a store's shard of row-sharded rows.
PARAMETER, READ_ONLY, STORE, ROW_SHARDED_STORE = "parameter", "read_only", "store", "row_sharded_store"
# parallel.table_sharding values whose rows each have one owner rank in the tables' row group
ROW_SHARDED, NODE_SHARED = "rows", "node"
ROW_SHARDINGS = (ROW_SHARDED, NODE_SHARED)


def module_holder(table_dtype: str) -> str:
    """Who holds a table's rows before any store takes them: fp32 rows are a parameter the engine's optimizer
    can train; bf16 and fp8 rows are served as they are (a run's plan moves trained bf16 rows into a store,
    `TablePlan.holder`)."""
    return PARAMETER if table_dtype == "fp32" else READ_ONLY


def shards_rows(table_sharding: str) -> bool:
    """Whether ``table_sharding`` splits each table's rows over the tables' row group (and so whether a
    layer needs that group to look its rows up)."""
    return table_sharding in ROW_SHARDINGS


@dataclass(frozen=True)
class TablePlan:
    """How one run keeps and trains its tables (see the module docstring)."""

    engine: str  # megatron | deepspeed
    dtype: str  # memory.table_dtype: fp32 | bf16
    state_dtype: str  # optimizer.table_state_dtype
    placement: str  # memory.table_placement: device | host
    sharding: str  # parallel.table_sharding: replicated | rows | node | zero
    update: str  # optimizer.table_update
    trainer: str  # ENGINE (the engine's optimizer or ZeRO) or STORES (fe_megatron's table optimizer)
    reasons: tuple = ()  # why STORES: the settings that asked for it
    sharded_backbone: bool = False  # the backbone under Megatron-FSDP: the tables are checkpointed beside its state
    shared_folder: str = "/dev/shm"  # node-shared tables: the node's shared-memory folder (parallel.shared_table_folder)
    recompute: str = "none"  # training.recompute: none | selective | full

    @classmethod
    def resolve(cls, engine: str = "megatron", dtype: str = "fp32", state_dtype: str = "fp32",
                placement: str = "device", sharding: str = "replicated", update: str = "adamw",
                bf16_run: bool = False, stage_without_memory: bool = False,
                expert_parallel: int = 1, sharded_backbone: bool = False,
                shared_folder: str = "/dev/shm", recompute: str = "none", one_pass_adamw: bool = False) -> "TablePlan":
        rule = update_rule(update)
        reasons = []
        if dtype != "fp32":
            reasons.append(f"memory.table_dtype={dtype}")
        if state_dtype != "fp32":
            reasons.append(f"optimizer.table_state_dtype={state_dtype}")
        if placement != "device":
            reasons.append(f"memory.table_placement={placement}")
        if rule.sparse:
            reasons.append(f"optimizer.table_update={update}")
        if sharding == "rows":
            reasons.append("row-sharded tables" + (" outside ZeRO" if engine == "deepspeed" else ""))
        if sharding == "node":
            reasons.append("node-shared tables" + (" outside ZeRO" if engine == "deepspeed" else ""))
        if engine == "megatron" and bf16_run:
            reasons.append("a bf16 run")
        if engine == "megatron" and expert_parallel > 1:
            reasons.append("an expert-parallel backbone")
        if engine == "megatron" and stage_without_memory:
            reasons.append("a pipeline stage without memory layers")
        if engine == "megatron" and sharded_backbone:
            reasons.append("a backbone under Megatron-FSDP")
        if engine == "megatron" and one_pass_adamw and not reasons:
            reasons.append("no distributed optimizer: the table optimizer's one-pass AdamW")
        return cls(engine, dtype, state_dtype, placement, sharding, update, STORES if reasons else ENGINE,
                   tuple(reasons), engine == "megatron" and sharded_backbone, shared_folder, recompute)

    @classmethod
    def for_run(cls, cfg, bf16_run: bool = False, stage_without_memory: bool = False,
                sharded_backbone: bool = False, fe_pretrain: bool = False) -> "TablePlan":
        """The plan of a `fe_megatron.training.config.TrainConfig` with memory (read, not imported:
        this layer sits below the training code).  ``stage_without_memory``: whether a pipeline
        stage of the run's layout holds no memory layer (the Megatron engine's question);
        ``sharded_backbone``: whether the backbone is under Megatron-FSDP (the Megatron-LM trainer's);
        ``fe_pretrain``: the run is fe-pretrain's, whose Megatron engine trains whole AdamW tables in
        one pass without the distributed optimizer (``one_pass_adamw``)."""
        memory, o, p = cfg.memory, cfg.optimizer, cfg.parallel
        return cls.resolve(cfg.training.engine, memory.table_dtype, o.table_state_dtype, memory.table_placement,
                           p.table_sharding, o.table_update, bf16_run, stage_without_memory, p.expert,
                           sharded_backbone, p.shared_table_folder, cfg.training.recompute,
                           one_pass_adamw=fe_pretrain and not p.distributed_optimizer)

    @classmethod
    def saved_mode(cls, info: dict):
        """The table `mode` of the run that wrote a checkpoint (its run info, ``fe_run.json``), None for a
        run without memory: the mode it recorded (``info["tables"]``), or, for a run saved before runs
        recorded it, the plan of its saved config (under DeepSpeed, where the config decides it alone) or
        ``parameters`` (under Megatron: before table stores, the tables were the engine's parameters)."""
        info = info or {}
        config, layout = info.get("config") or {}, info.get("layout") or {}
        if config.get("memory") is None:
            return None
        if info.get("tables") is not None:
            return info["tables"]
        engine = layout.get("engine", "megatron")
        if engine != "deepspeed":
            return "parameters"
        memory, optimizer = config["memory"], config.get("optimizer") or {}
        return cls.resolve(engine, memory.get("table_dtype", "fp32"), optimizer.get("table_state_dtype", "fp32"),
                           memory.get("table_placement", "device"), layout.get("table_sharding", "replicated"),
                           optimizer.get("table_update", "adamw")).mode

    @property
    def row_sharded(self) -> bool:
        """Whether every row has one owner rank in the tables' row group (``rows``, and ``node``, whose
        nodes share their ranks' rows)."""
        return shards_rows(self.sharding)

    @property
    def node_shared(self) -> bool:
        return self.sharding == NODE_SHARED

    @property
    def in_stores(self) -> bool:
        return self.trainer == STORES

    @property
    def holder(self) -> str:
        """Who holds a trained layer's rows in this run (`fe_megatron.tables.holders`): the engine's
        parameter, a store, or a store's shard of row-sharded rows."""
        if not self.in_stores:
            return PARAMETER
        return ROW_SHARDED_STORE if self.row_sharded else STORE

    @property
    def lookahead(self) -> bool:
        """Whether each microbatch's table rows are fetched one microbatch ahead (`fe_megatron.tables.
        lookahead`): tables in host memory, except under full recompute, whose layers run twice and
        look their rows up themselves."""
        return self.placement == "host" and self.recompute != "full"

    @property
    def tables_in_model_state_dict(self) -> bool:
        """Whether the model's state dict holds the tables (Megatron's dist-checkpoint saves them with the
        model), or they are checkpointed in files of their own: the DeepSpeed engine's, and beside a
        backbone under Megatron-FSDP, whose ``fsdp_dtensor`` checkpoint would take a store's rows for a
        replicated tensor (`fe_megatron.megatron_lm.fsdp_checkpoint`)."""
        return self.engine == "megatron" and not self.sharded_backbone

    @property
    def rule(self) -> UpdateRule:
        """The update rule's entry (`fe_megatron.tables.update_rules`)."""
        return update_rule(self.update)

    @property
    def sparse(self) -> bool:
        return self.rule.sparse

    @property
    def mode(self) -> str:
        """The DeepSpeed engine's table mode: ``zero`` (ZeRO's parameters), ``rows`` (row-sharded
        outside ZeRO, node-shared too: the same files) or ``replicated`` (whole, in stores outside ZeRO);
        under Megatron ``stores`` or ``parameters`` (what its checkpoints record as ``tables``)."""
        if self.engine == "megatron":
            return "stores" if self.in_stores else "parameters"
        if self.row_sharded:
            return "rows"
        return "replicated" if self.in_stores else "zero"

    def state_bytes_per_parameter(self, width: int) -> float:
        """Bytes of optimizer state per table parameter (rows of ``width`` columns on this rank)."""
        return self.rule.state_bytes_per_parameter(width, self.state_dtype)

    def gradient_bytes_per_parameter(self) -> int:
        """Bytes of gradient accumulator per table parameter: none for the sparse rules, whose gradient
        is kept by touched row (its size follows the batch, not the table)."""
        return 0 if self.sparse else DTYPE_BYTES[self.state_dtype]

    def describe(self) -> str:
        """One line for the start of a run, e.g. ``tables bf16 (state bf16) in stores in host
        memory, rows, updated by rowwise_adagrad (touched rows only)``."""
        update = f", updated by {self.update}" + (" (touched rows only)" if self.sparse else " (every row)")
        if not self.in_stores:
            trainer = "ZeRO's parameters" if self.engine == "deepspeed" else "the engine's parameters"
            return f"tables {self.dtype} as {trainer}, {self.sharding}{update}"
        state = f" (state {self.state_dtype})" if self.state_dtype != "fp32" else ""
        where = "in host memory" if self.placement == "host" else "on the device"
        if self.node_shared:
            where = f"in shared host memory ({self.shared_folder}), one copy per node"
        return (f"tables {self.dtype}{state} in stores {where}, {self.sharding}{update}; in stores because of "
                f"{', '.join(self.reasons)}")
