"""`TrainConfig`: a pretraining run, loaded from YAML with ``section.key=value`` overrides.

Sections: ``model`` (the backbone, `BackboneConfig`: fields, or ``preset: NAME`` plus overrides),
``memory`` (a `MemoryConfig`: ``preset:`` plus any field; ``null`` or absent trains the plain
Transformer with the same backbone), ``parallel``, ``optimizer``, ``training``, ``data``, and,
with ``training.engine: deepspeed``, ``deepspeed`` (a DeepSpeed JSON config: its path, or its
keys inline; docs/deepspeed.md).

The backbone is written once, in ``model``: it is the memory's backbone too, so ``memory`` holds
no backbone field.  The model kind is the memory's ``kind`` (``factorengram`` or ``engram``), or
``transformer`` without a memory section.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import List, Optional

from fe_megatron.config import (GATES, MEMORY_KINDS, PLACEMENTS, TABLE_DTYPES, TABLE_PLACEMENTS, BackboneConfig,
                                ConfigError, MemoryConfig, load_yaml, read_yaml_mapping)
from fe_megatron.memory.sharding import TABLE_SHARDINGS
from fe_megatron.tables.optimizer import STATE_DTYPES
from fe_megatron.tables.plan import TablePlan
from fe_megatron.tables.update_rules import TABLE_UPDATES
from fe_megatron.ops import BACKEND_NAMES
from fe_megatron.suggest import unknown_name

KERNEL_BACKENDS = ("auto",) + BACKEND_NAMES
TRANSFORMER_IMPLS = ("local", "te")
ENGINES = ("megatron", "deepspeed")
TABLE_STATE_DTYPES = tuple(STATE_DTYPES)


@dataclass
class ParallelArgs:
    tensor: int = 1
    pipeline: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    # replicated | rows: tables' rows sharded over the data-parallel ranks | node: split as rows, each node's
    # rows kept once in shared host memory (memory.table_placement: host) | zero (DeepSpeed: ZeRO partitions them)
    table_sharding: str = "replicated"
    # table_sharding node: the folder of each node's shared-memory segments (a tmpfs: /dev/shm)
    shared_table_folder: str = "/dev/shm"
    prefetch_table_rows: bool = True  # rows: start every layer's row exchange at the start of the microbatch
    expert: int = 1  # Megatron's expert-parallel size for an MoE backbone (model.num_experts); the tables' own
    # row group (table_sharding rows) is every data-parallel rank whatever this is
    # how long a rank waits for its peers in a collective (and at start-up) before it fails: a lost host
    # stops the job after this long (docs/operations.md, "Many nodes"); Megatron-LM's --distributed-timeout-minutes
    distributed_timeout_minutes: float = 10.0


@dataclass
class OptimizerArgs:
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 1024
    table_lr_mult: float = 1.0
    table_weight_decay_mult: float = 1.0  # the paper's: decay the tables like every weight; 0 = Engram-style exemption
    table_state_dtype: str = "fp32"  # fp32 | bf16: the tables' gradient accumulators and Adam moments (docs/tables.md)
    # adamw (every row, the paper's) or a sparse rule, which updates only the rows a step touched
    # (fe_megatron.tables.update_rules: rowwise_adagrad, lazy_adam, partial_rowwise_adam; docs/tables.md)
    table_update: str = "adamw"


@dataclass
class TrainingArgs:
    engine: str = "megatron"  # megatron (megatron.core, any TP/PP/DP) | deepspeed (the HF model under ZeRO)
    train_steps: int = 57344
    micro_batch_size: int = 1
    global_batch_size: int = 64
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    recompute: str = "none"  # none | full
    transformer_impl: str = "local"  # local (megatron.core's modules; runs on CPU) | te (Transformer Engine)
    kernel_backend: str = "auto"  # auto (fastest built) | torch | cpp | cuda | triton: see docs/kernels.md
    deterministic_table_grads: bool = True  # False: atomic adds in the GPU table backward (not reproducible)
    log_interval: int = 10
    eval_interval: int = 1000
    eval_steps: int = 10
    save_interval: int = 1000
    keep_checkpoints: int = 0  # keep the newest K checkpoints, delete older ones; 0 = keep all
    on_corrupt_checkpoint: str = "error"  # error | previous: resume from the newest intact one before it
    on_nonfinite: str = "halt"  # halt (exit 3, nothing saved) | skip (drop the step's update, count it)
    freeze_backbone: bool = False  # train only the memory branches (continued pretraining after fe-convert graft)
    exit_after: int = 0  # stop (after saving) once this many steps are done; 0 = run to train_steps
    schedule_on_resume: str = "checkpoint"  # checkpoint (keep the saved LR schedule) | config (take this config's)


@dataclass
class DataArgs:
    tokenizer_model: str = ""
    # PREFIX (one indexed dataset), [PREFIX], or [weight, prefix, weight, prefix, ...] (a blend)
    train_data: List = field(default_factory=list)
    split: str = "98,1,1"
    cache_dir: Optional[str] = None
    # documents packed into one sample, isolated (Megatron-LM's --reset-position-ids, --reset-attention-mask): the
    # positions restart after each end-of-document token, and with them the memory's n-grams (no n-gram spans
    # two documents); the attention stays within each document
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.train_data, str):  # one prefix, written bare: data.train_data=PREFIX
            self.train_data = [self.train_data]


# The range of each number a field section takes, beside the type its dataclass declares (`field_type_problem`):
# every field is checked for its type, and these for their range too.
AT_LEAST_ONE, NOT_NEGATIVE, POSITIVE, FRACTION = ">= 1", ">= 0", "> 0", "in [0, 1)"
FIELD_RANGES = {
    "parallel.tensor": AT_LEAST_ONE, "parallel.pipeline": AT_LEAST_ONE, "parallel.expert": AT_LEAST_ONE,
    "parallel.distributed_timeout_minutes": POSITIVE,
    "optimizer.lr": POSITIVE, "optimizer.min_lr": NOT_NEGATIVE, "optimizer.weight_decay": NOT_NEGATIVE,
    "optimizer.beta1": FRACTION, "optimizer.beta2": FRACTION, "optimizer.eps": POSITIVE,
    "optimizer.clip_grad": NOT_NEGATIVE, "optimizer.warmup_steps": NOT_NEGATIVE,
    "optimizer.table_lr_mult": NOT_NEGATIVE, "optimizer.table_weight_decay_mult": NOT_NEGATIVE,
    "training.train_steps": AT_LEAST_ONE, "training.micro_batch_size": AT_LEAST_ONE,
    "training.global_batch_size": AT_LEAST_ONE, "training.seed": NOT_NEGATIVE,
    "training.log_interval": AT_LEAST_ONE, "training.eval_interval": AT_LEAST_ONE,
    "training.eval_steps": AT_LEAST_ONE, "training.save_interval": NOT_NEGATIVE,
    "training.exit_after": NOT_NEGATIVE, "training.keep_checkpoints": NOT_NEGATIVE,
}
# what a field's number means, said after its range in a message
FIELD_NOTES = {"training.keep_checkpoints": "0 keeps all", "parallel.distributed_timeout_minutes":
               "minutes; 10 is Megatron-LM's default", "training.exit_after": "0 runs to training.train_steps",
               "training.save_interval": "0 saves at the end only"}
IN_RANGE = {AT_LEAST_ONE: lambda v: v >= 1, NOT_NEGATIVE: lambda v: v >= 0, POSITIVE: lambda v: v > 0,
            FRACTION: lambda v: 0 <= v < 1}


def field_type_problem(value, kind, value_range: Optional[str] = None) -> Optional[str]:
    """What is wrong with ``value`` for a field declared ``kind`` (int, float, bool, str, a list, or
    Optional of one) and bounded by ``value_range`` (a `FIELD_RANGES` entry); None when it fits."""
    if typing.get_origin(kind) is typing.Union:  # Optional[X]
        if value is None:
            return None
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    if kind is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if kind is str:
        return None if isinstance(value, str) else "must be a string"
    if typing.get_origin(kind) is list or kind is list:
        return None if isinstance(value, list) else "must be a list"
    if kind is int:
        fits, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    else:  # float
        fits = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        expected = "a finite number"
    if fits and (not value_range or IN_RANGE[value_range](value)):
        return None
    return f"must be {expected}{' ' + value_range if value_range else ''}"


@dataclass
class TrainConfig:
    model: BackboneConfig = field(default_factory=BackboneConfig)
    memory: Optional[MemoryConfig] = None
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    data: DataArgs = field(default_factory=DataArgs)
    save: Optional[str] = None
    load: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    deepspeed: Optional[object] = None  # engine deepspeed: a DeepSpeed JSON config's path, or its keys (a mapping)

    @property
    def model_kind(self) -> str:
        """``factorengram``, ``engram`` (the memory's kind) or ``transformer`` (no memory)."""
        return "transformer" if self.memory is None else self.memory.kind

    def validate(self, where: Optional[dict] = None) -> None:
        where = where or {}
        t, o = self.training, self.optimizer

        def fail(section: str, name: str, message: str):
            raise ConfigError(name, message, _where(where, section, name), section)

        self._validate_field_types(fail)
        if t.global_batch_size % t.micro_batch_size:
            fail("training", "global_batch_size", f"{t.global_batch_size} is not a multiple of "
                                                  f"micro_batch_size={t.micro_batch_size}")
        if not 0 <= o.warmup_steps < t.train_steps:
            fail("optimizer", "warmup_steps", f"{o.warmup_steps} must lie in [0, training.train_steps="
                                              f"{t.train_steps})")
        if t.precision not in ("auto", "bf16", "fp32"):
            fail("training", "precision", f"{t.precision!r} is not one of auto, bf16, fp32")
        if t.recompute not in ("none", "full"):
            fail("training", "recompute", f"{t.recompute!r} is not one of none, full")
        if self.parallel.table_sharding not in TABLE_SHARDINGS:
            fail("parallel", "table_sharding",
                 f"{self.parallel.table_sharding!r} is not one of {tuple(TABLE_SHARDINGS)}")
        if t.transformer_impl not in TRANSFORMER_IMPLS:
            fail("training", "transformer_impl", f"{t.transformer_impl!r} is not one of {TRANSFORMER_IMPLS}")
        if t.on_corrupt_checkpoint not in ("error", "previous"):
            fail("training", "on_corrupt_checkpoint", f"{t.on_corrupt_checkpoint!r} is not one of error, previous")
        if t.on_nonfinite not in ("halt", "skip"):
            fail("training", "on_nonfinite", f"{t.on_nonfinite!r} is not one of halt, skip")
        if t.schedule_on_resume not in ("checkpoint", "config"):
            fail("training", "schedule_on_resume", f"{t.schedule_on_resume!r} is not one of checkpoint, config")
        if t.freeze_backbone and self.memory is None:
            fail("training", "freeze_backbone", "is true but memory is null: there would be nothing to train")
        self._validate_table_storage(fail)
        self._validate_engine(fail)
        if t.kernel_backend not in KERNEL_BACKENDS:
            fail("training", "kernel_backend", f"{t.kernel_backend!r} is not one of {KERNEL_BACKENDS}")
        if not self.data.tokenizer_model:
            fail("data", "tokenizer_model", "is empty; give a sentencepiece .model file or a Hugging Face "
                                            "tokenizer directory")
        self._validate_blend(fail)

    def _validate_field_types(self, fail) -> None:
        """Every field of the field sections has the type its dataclass declares, and a number its range
        (`FIELD_RANGES`), before any check compares or computes with it."""
        for section, cls in FIELD_SECTIONS.items():
            values, kinds = getattr(self, section), typing.get_type_hints(cls)
            for item in dataclasses.fields(cls):
                value = getattr(values, item.name)
                name = f"{section}.{item.name}"
                problem = field_type_problem(value, kinds[item.name], FIELD_RANGES.get(name))
                if problem:
                    note = f" ({FIELD_NOTES[name]})" if name in FIELD_NOTES else ""
                    fail(section, item.name, f"{value!r} {problem}{note}")

    def _validate_blend(self, fail) -> None:
        """``data.train_data``: one prefix, or weight/prefix pairs with numbers for weights."""
        blend = self.data.train_data
        form = ("one indexed-dataset prefix (data.train_data=PREFIX, for PREFIX.bin/.idx) or weight/prefix pairs "
                "(data.train_data=[0.7,PREFIX_A,0.3,PREFIX_B])")
        if not blend:
            fail("data", "train_data", f"is empty; give {form}")
        if len(blend) == 1:
            if not isinstance(blend[0], str) or not blend[0]:
                fail("data", "train_data", f"{blend!r} must be {form}")
            return
        weights, prefixes = blend[0::2], blend[1::2]
        if len(blend) % 2 or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0
                                     for w in weights) or not all(isinstance(p, str) and p for p in prefixes):
            fail("data", "train_data", f"{blend!r} must be {form}, each weight a number > 0")

    def _validate_hybrid(self, fail) -> None:
        """What fe-pretrain builds of a hybrid backbone (megatron-core's HybridModel)."""
        from fe_megatron.hybrid_pattern import pipeline_segments

        pattern, t = self.model.hybrid_layer_pattern, self.training
        if t.engine != "megatron":
            fail("model", "hybrid_layer_pattern", "is built by the Megatron engine (training.engine=megatron); the "
                                                  "DeepSpeed engine builds the GPT model")
        if t.transformer_impl != "local":
            fail("training", "transformer_impl", f"{t.transformer_impl!r} with model.hybrid_layer_pattern: fe-pretrain "
                                                 "builds the hybrid stack from megatron-core's local layers; set "
                                                 "local (Transformer Engine's hybrid stack: fe_megatron.megatron_lm."
                                                 "pretrain_hybrid)")
        try:
            pipeline_segments(pattern, self.parallel.pipeline, pipeline_flag="parallel.pipeline")
        except ValueError as error:
            fail("model", "hybrid_layer_pattern", str(error))
        if self.memory is not None and self.memory.placement != "before_attn":
            fail("memory", "placement", f"{self.memory.placement!r}: the hybrid model places the memory before the "
                                        "attention of its attention layers ('before_attn')")

    def _validate_table_storage(self, fail) -> None:
        """The tables' storage (docs/tables.md): what trains, and what each engine can hold."""
        o, memory = self.optimizer, self.memory
        if o.table_state_dtype not in TABLE_STATE_DTYPES:
            fail("optimizer", "table_state_dtype", f"{o.table_state_dtype!r} is not one of {TABLE_STATE_DTYPES}")
        if o.table_update not in TABLE_UPDATES:
            fail("optimizer", "table_update", f"{o.table_update!r} is not one of {TABLE_UPDATES}")
        if memory is None:
            return
        if memory.table_dtype == "fp8":
            fail("memory", "table_dtype", "'fp8' is a serving format (fe-convert --table-dtype fp8); fe-pretrain "
                                          "trains fp32 or bf16 tables: set memory.table_dtype=fp32 or bf16")
        if self.parallel.table_sharding == "node" and memory.table_placement != "host":
            fail("memory", "table_placement", f"{memory.table_placement!r}: node-shared tables "
                                              "(parallel.table_sharding: node) live in host memory; set "
                                              "memory.table_placement: host, or use table_sharding rows")
        if self.training.engine == "deepspeed" and self.parallel.table_sharding == "zero":
            plan = TablePlan.for_run(self)
            if plan.in_stores:
                fail("parallel", "table_sharding", f"'zero' keeps the tables as ZeRO's parameters, which cannot hold "
                                                   f"{plan.reasons[0]}; use table_sharding rows (or replicated: whole "
                                                   "tables outside ZeRO) for bf16 tables, the host tier, bf16 state "
                                                   "or a sparse table update")

    def _validate_engine(self, fail) -> None:
        t, p = self.training, self.parallel
        if t.engine not in ENGINES:
            fail("training", "engine", f"{t.engine!r} is not one of {ENGINES}")
        if self.model.hybrid_layer_pattern:
            self._validate_hybrid(fail)
        if p.expert > 1 and (not self.model.num_experts or self.model.num_experts % p.expert):
            fail("parallel", "expert", f"{p.expert} must divide model.num_experts={self.model.num_experts} (the "
                                       "experts are split evenly over the expert-parallel ranks); set "
                                       "parallel.expert=1 for a dense backbone")
        if t.engine == "megatron":
            if self.deepspeed is not None:
                fail(None, "deepspeed", "is read by training.engine=deepspeed only; set it, or remove the section")
            if p.table_sharding == "zero":
                fail("parallel", "table_sharding", "'zero' (tables partitioned by ZeRO) needs training.engine="
                                                   "deepspeed; under Megatron use replicated or rows")
            if self.data.reset_attention_mask and t.transformer_impl != "local":
                fail("data", "reset_attention_mask", f"with training.transformer_impl={t.transformer_impl!r}: "
                                                     "fe-pretrain hands each sample's mask to megatron-core's local "
                                                     "attention; set transformer_impl=local (Transformer Engine's "
                                                     "packed attention: fe_megatron.megatron_lm.pretrain_gpt)")
            return
        if not (self.deepspeed is None or isinstance(self.deepspeed, (str, dict))):
            fail(None, "deepspeed", f"must be a DeepSpeed JSON file's path or a mapping of its keys, got "
                                  f"{self.deepspeed!r}")
        for name, value, default in (("tensor", p.tensor, 1), ("pipeline", p.pipeline, 1),
                                     ("sequence_parallel", p.sequence_parallel, False),
                                     ("distributed_optimizer", p.distributed_optimizer, False)):
            if value != default:
                fail("parallel", name, f"{value!r}: the DeepSpeed engine is data-parallel (ZeRO) only; set "
                                       f"parallel.{name}={str(default).lower()} or use training.engine=megatron")
        if self.model.num_experts:
            fail("model", "num_experts", f"{self.model.num_experts}: the DeepSpeed engine trains the Hugging Face "
                                         "model, whose FFN is dense; set model.num_experts=0 or use "
                                         "training.engine=megatron")
        if t.transformer_impl != "local":
            fail("training", "transformer_impl", f"{t.transformer_impl!r}: the DeepSpeed engine trains the Hugging "
                                                 "Face model; set transformer_impl=local")
        if t.on_nonfinite != "halt":
            fail("training", "on_nonfinite", f"{t.on_nonfinite!r}: DeepSpeed's fp32 step cannot be skipped once "
                                             "taken; the DeepSpeed engine halts (on_nonfinite=halt)")
        if self.data.reset_attention_mask != self.data.reset_position_ids:
            fail("data", "reset_attention_mask", f"{self.data.reset_attention_mask} beside data.reset_position_ids="
                                                 f"{self.data.reset_position_ids}: the DeepSpeed engine's Hugging Face "
                                                 "model keeps its attention within the documents its position ids "
                                                 "restart (transformers' packed sequences); set both alike")


def _where(where: dict, section: str, name: str) -> Optional[str]:
    """The ``file:line`` (or override) of ``section.name``; with ``name`` empty, of the section itself:
    for a section given as a mapping, where its first key is."""
    entry = where.get(section, {})
    if not isinstance(entry, dict):
        return entry
    if name:
        return entry.get(name)
    while isinstance(entry, dict) and entry:
        entry = next(iter(entry.values()))
    return entry or None


# the sections that are mappings of plain fields, and their classes
FIELD_SECTIONS = {"parallel": ParallelArgs, "optimizer": OptimizerArgs, "training": TrainingArgs, "data": DataArgs}
# The fields that take one of a fixed list of names (the lists their checks use): an unknown field given one
# of these names, ``memory.tables=rowwise_adagrad``, is answered with the field that takes it.
FIELD_CHOICES = {"memory.kind": MEMORY_KINDS, "memory.gate": GATES, "memory.placement": PLACEMENTS,
                 "memory.table_dtype": TABLE_DTYPES, "memory.table_placement": TABLE_PLACEMENTS,
                 "parallel.table_sharding": tuple(TABLE_SHARDINGS), "optimizer.table_update": TABLE_UPDATES,
                 "optimizer.table_state_dtype": TABLE_STATE_DTYPES, "training.engine": ENGINES,
                 "training.transformer_impl": TRANSFORMER_IMPLS, "training.kernel_backend": KERNEL_BACKENDS}
SECTION_FIELDS = {"model": BackboneConfig, "memory": MemoryConfig, **FIELD_SECTIONS}

# sections that may be given as the path of a JSON file (the DeepSpeed config)
JSON_FILE_SECTIONS = ("deepspeed",)


def _read_json_section(path: str, item: str) -> dict:
    import json

    try:
        with open(path) as fh:
            values = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(item.split("=", 1)[0], f"the override {item!r} reaches into {path}, which cannot be "
                                                 f"read as JSON ({err})", section=None) from None
    if not isinstance(values, dict):
        raise ConfigError(item.split("=", 1)[0], f"{path} holds {type(values).__name__}, not a JSON object",
                          section=None)
    return values


def _set_dotted(tree: dict, where: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(item, "overrides must look like section.key=value", section=None)
    key, text = item.split("=", 1)
    parts = key.split(".")
    node, lines = tree, where
    for depth, part in enumerate(parts[:-1]):
        if depth == 0 and part in JSON_FILE_SECTIONS and isinstance(node.get(part), str):
            node[part] = _read_json_section(node[part], item)  # the override reaches into the file's keys
        node = node.setdefault(part, {})
        if node is None:  # e.g. memory.layers=... after memory=null
            raise ConfigError(key, f"cannot set {key}: section {part} is null", section=None)
        if not isinstance(node, dict):
            raise ConfigError(key, f"cannot set {key}: {part} is not a section", section=None)
        lines = lines.setdefault(part, {}) if isinstance(lines.get(part, {}), dict) else {}
    try:
        node[parts[-1]] = load_yaml(text)
    except Exception as error:  # yaml's errors (e.g. a leading '*' reads as an alias)
        problem = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(key, f"the override '{item}' holds no YAML value ({problem}); quote a string in single "
                               f"quotes inside the shell's: {key}=\"'{text}'\"", section=None) from None
    lines[parts[-1]] = f"override '{item}'"


def _check_names_given_as_fields(tree: dict, where: dict) -> None:
    """An unknown field whose value is a name one field takes (`FIELD_CHOICES`) is refused with that field:
    ``memory.tables=rowwise_adagrad`` with ``did you mean optimizer.table_update=rowwise_adagrad?``, not with
    the field whose name is closest."""
    for section, cls in SECTION_FIELDS.items():
        values = tree.get(section)
        if not isinstance(values, dict):
            continue
        known = {f.name for f in dataclasses.fields(cls)} | {"preset"}
        for key in sorted(set(values) - known):
            value = values[key]
            if not isinstance(value, str):
                continue
            takers = [name for name, choices in FIELD_CHOICES.items() if value in choices]
            if takers:
                fields = " or ".join(f"{name}={value}" for name in takers)
                raise ConfigError(key, f"unknown field; {value} is a value of {' and of '.join(takers)}: "
                                       f"did you mean {fields}?", _where(where, section, key), section)


def _build_section(cls, values, section: str, where: dict):
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(section, f"must be a mapping of fields, got {values!r}", _where(where, section, ""), None)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        key = unknown[0]
        owners = [name for name, other in FIELD_SECTIONS.items()
                  if other is not cls and key in {f.name for f in dataclasses.fields(other)}]
        message = (f"unknown field; {key} is a field of {owners[0]}: did you mean {owners[0]}.{key}?" if owners
                   else unknown_name("field", key, known, prefix=f"{section}."))
        raise ConfigError(key, message, _where(where, section, key), section)
    return cls(**values)


def load_train_config(path: Optional[str], overrides: List[str] = ()) -> TrainConfig:
    """A YAML file (may be None) plus ``section.key=value`` overrides (values parsed as YAML).
    Errors name the section, the field, and the file and line (or the override) it came from."""
    tree, where = read_yaml_mapping(path) if path is not None else ({}, {})
    for item in overrides:
        _set_dotted(tree, where, item)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(tree) - known)
    if unknown:
        raise ConfigError(unknown[0], unknown_name("section", unknown[0], known), _where(where, unknown[0], ""), None)
    _check_names_given_as_fields(tree, where)
    model_where = where.get("model") if isinstance(where.get("model"), dict) else {}
    try:
        model = BackboneConfig.from_dict(tree.get("model") or {}, model_where)
    except ConfigError as err:
        raise err.relocated("model") from None
    memory = None
    memory_tree = tree.get("memory")
    if memory_tree is not None:
        memory_where = where.get("memory") if isinstance(where.get("memory"), dict) else {}
        if not isinstance(memory_tree, dict):
            raise ConfigError("memory", f"must be a mapping (preset: ... plus fields) or null, got {memory_tree!r}",
                              None, None)
        if "backbone" in memory_tree:
            raise ConfigError("backbone", "the memory's backbone is the model section; remove memory.backbone",
                              memory_where.get("backbone"), "memory")
        memory_tree = _pattern_layers_as_blocks(memory_tree, memory_where, model)
        try:
            memory = MemoryConfig.from_dict(memory_tree, memory_where, backbone=model)
        except ConfigError as err:
            raise err.relocated("memory" if err.section == "MemoryConfig" else err.section) from None
    try:
        config = TrainConfig(
            model=model, memory=memory,
            parallel=_build_section(ParallelArgs, tree.get("parallel"), "parallel", where),
            optimizer=_build_section(OptimizerArgs, tree.get("optimizer"), "optimizer", where),
            training=_build_section(TrainingArgs, tree.get("training"), "training", where),
            data=_build_section(DataArgs, tree.get("data"), "data", where),
            save=tree.get("save"), load=tree.get("load"), tensorboard_dir=tree.get("tensorboard_dir"),
            deepspeed=tree.get("deepspeed"))
    except TypeError as err:  # a dataclass given a value it cannot take
        raise ConfigError("config", str(err), path, None) from None
    try:
        config.validate(where)
    except ConfigError as err:
        raise _name_other_overrides(err, overrides) from None
    return config


def _pattern_layers_as_blocks(memory_tree: dict, memory_where: dict, model: BackboneConfig) -> dict:
    """``memory.pattern_layers`` (a hybrid backbone's layer numbers, each an attention layer) as the
    ``memory.layers`` they are: blocks, the i-th attention layer (`fe_megatron.hybrid_pattern`)."""
    if "pattern_layers" not in memory_tree:
        return memory_tree
    where = memory_where.get("pattern_layers")
    if not model.hybrid_layer_pattern:
        raise ConfigError("pattern_layers", "names layers of model.hybrid_layer_pattern, which is not set; give "
                                            "memory.layers (0-based blocks) for the GPT model", where, "memory")
    if "layers" in memory_tree:
        raise ConfigError("pattern_layers", "and memory.layers are both set; give one (pattern_layers: the pattern's "
                                            "layer numbers; layers: its attention layers, 0-based)", where, "memory")
    numbers = memory_tree["pattern_layers"]
    if not isinstance(numbers, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        raise ConfigError("pattern_layers", f"{numbers!r} must be a list of layer numbers", where, "memory")
    from fe_megatron.hybrid_pattern import memory_blocks_of_layers

    try:
        blocks = memory_blocks_of_layers(model.hybrid_layer_pattern, numbers, flag="memory.pattern_layers")
    except ValueError as error:
        raise ConfigError("pattern_layers", str(error).split(": ", 1)[-1], where, "memory") from None
    tree = {key: value for key, value in memory_tree.items() if key != "pattern_layers"}
    tree["layers"] = blocks
    return tree


def _name_other_overrides(err: ConfigError, overrides: List[str]) -> ConfigError:
    """A check across fields (``optimizer.warmup_steps: 20 must lie in [0, training.train_steps=5)``)
    is reported at the checked field's file line; when another field it names was set by an override,
    say so, since that override is what the user just changed."""
    named = []
    for item in overrides:
        key = item.split("=", 1)[0]
        if key != err.path and re.search(rf"(?<![\w.]){re.escape(key)}=", err.detail):
            named.append(f"'{item}'")
    if not named:
        return err
    return ConfigError(err.field, f"{err.detail} (set by the override {', '.join(named)})", err.where, err.section)
