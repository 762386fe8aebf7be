"""`TrainConfig`: a pretraining run, loaded from YAML with ``key=value`` overrides.

The memory branch is described by `MemoryConfig` (the ``memory:`` section, usually a
preset plus overrides); its backbone fields (``vocab_size``, ``hidden_size``,
``num_layers``, ``ffn_hidden_size``) are taken from the ``model:`` section, the one place
they are written. Setting them differently in ``memory:`` is an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import yaml

from fe_megatron.config import ConfigError, MemoryConfig
from fe_megatron.ops import BACKEND_NAMES
from fe_megatron.presets import PRESETS

KINDS = ("factorengram", "engram", "transformer")
KERNEL_BACKENDS = ("auto",) + BACKEND_NAMES
_SHARED_WITH_MEMORY = ("vocab_size", "hidden_size", "num_layers", "ffn_hidden_size")


@dataclass
class ModelArgs:
    kind: str = "factorengram"  # factorengram | engram | transformer (same backbone, no memory)
    num_layers: int = 24
    hidden_size: int = 1024
    num_attention_heads: int = 16
    ffn_hidden_size: int = 2816
    vocab_size: int = 32000  # the embedding size; must be >= the tokenizer's vocabulary
    seq_length: int = 8192
    backend: str = "local"  # local | te


@dataclass
class ParallelArgs:
    tensor: int = 1
    pipeline: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False


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
    table_weight_decay_mult: float = 0.0


@dataclass
class TrainingArgs:
    train_steps: int = 57344
    micro_batch_size: int = 1
    global_batch_size: int = 64
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    recompute: str = "none"  # none | full
    kernel_backend: str = "auto"  # auto (fastest built) | torch | cpp | cuda | triton: see docs/kernels.md
    deterministic_table_grads: bool = True  # False: atomic adds in the GPU table backward (not reproducible)
    log_interval: int = 10
    eval_interval: int = 1000
    eval_steps: int = 10
    save_interval: int = 1000
    exit_after: int = 0  # stop (after saving) once this many steps are done; 0 = run to train_steps


@dataclass
class DataArgs:
    tokenizer_model: str = ""
    train_data: List = field(default_factory=list)  # [prefix] or [weight, prefix, weight, prefix, ...]
    split: str = "98,1,1"
    cache_dir: Optional[str] = None


@dataclass
class TrainConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    memory: Optional[MemoryConfig] = None
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    data: DataArgs = field(default_factory=DataArgs)
    save: Optional[str] = None
    load: Optional[str] = None
    tensorboard_dir: Optional[str] = None

    def validate(self) -> None:
        m, t = self.model, self.training
        if m.kind not in KINDS:
            raise ConfigError("model.kind", f"{m.kind!r} is not one of {KINDS}")
        if m.kind != "transformer":
            if self.memory is None:
                raise ConfigError("memory", f"model.kind={m.kind!r} needs a memory section (e.g. preset: ...)")
            want = "dense" if m.kind == "engram" else "factorized"
            if self.memory.representation != want:
                raise ConfigError("memory.representation", f"{self.memory.representation!r} does not match "
                                                           f"model.kind={m.kind!r} (expected {want!r})")
        if t.global_batch_size % t.micro_batch_size:
            raise ConfigError("training.global_batch_size", f"{t.global_batch_size} is not a multiple of "
                                                            f"micro_batch_size={t.micro_batch_size}")
        if not 0 <= self.optimizer.warmup_steps < t.train_steps:
            raise ConfigError("optimizer.warmup_steps", f"{self.optimizer.warmup_steps} must lie in "
                                                        f"[0, training.train_steps={t.train_steps})")
        if t.precision not in ("auto", "bf16", "fp32"):
            raise ConfigError("training.precision", f"{t.precision!r} is not one of auto, bf16, fp32")
        if t.recompute not in ("none", "full"):
            raise ConfigError("training.recompute", f"{t.recompute!r} is not one of none, full")
        if t.kernel_backend not in KERNEL_BACKENDS:
            raise ConfigError("training.kernel_backend", f"{t.kernel_backend!r} is not one of {KERNEL_BACKENDS}")
        if not self.data.tokenizer_model:
            raise ConfigError("data.tokenizer_model", "is empty; give a sentencepiece .model file")
        if not self.data.train_data:
            raise ConfigError("data.train_data", "is empty; give an indexed-dataset prefix (PREFIX.bin/.idx)")

    @property
    def memory_config(self) -> Optional[MemoryConfig]:
        return None if self.model.kind == "transformer" else self.memory


def _set_dotted(tree: dict, key: str, value) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"cannot set {key}: {part} is not a section")
    node[parts[-1]] = value


def _build_section(cls, values: dict, section: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]}", f"unknown field (known: {', '.join(sorted(known))})")
    return cls(**values)


def load_train_config(path: Optional[str], overrides: List[str] = ()) -> TrainConfig:
    """YAML file (may be None) plus ``section.key=value`` overrides (values parsed as YAML)."""
    tree = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: invalid YAML: {err}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "overrides must look like section.key=value")
        key, value = item.split("=", 1)
        _set_dotted(tree, key, yaml.safe_load(value))
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(tree) - known)
    if unknown:
        raise ConfigError(unknown[0], f"unknown section (known: {', '.join(sorted(known))})")
    model = _build_section(ModelArgs, tree.get("model", {}), "model")
    memory = None
    memory_tree = tree.get("memory")
    if memory_tree is not None:
        memory_tree = dict(memory_tree)
        preset = memory_tree.pop("preset", None)
        if preset and preset not in PRESETS:
            raise ConfigError("memory.preset", f"unknown preset {preset!r}; available: {', '.join(sorted(PRESETS))}")
        values = dict(PRESETS[preset]) if preset else {}
        for name in _SHARED_WITH_MEMORY:
            if name in memory_tree and memory_tree[name] != getattr(model, name):
                raise ConfigError(f"memory.{name}", f"{memory_tree[name]} conflicts with model.{name}="
                                                    f"{getattr(model, name)}; set it in the model section only")
            values[name] = getattr(model, name)
        values.update({k: v for k, v in memory_tree.items() if k not in _SHARED_WITH_MEMORY})
        memory = MemoryConfig.from_dict(values)
    config = TrainConfig(
        model=model, memory=memory,
        parallel=_build_section(ParallelArgs, tree.get("parallel", {}), "parallel"),
        optimizer=_build_section(OptimizerArgs, tree.get("optimizer", {}), "optimizer"),
        training=_build_section(TrainingArgs, tree.get("training", {}), "training"),
        data=_build_section(DataArgs, tree.get("data", {}), "data"),
        save=tree.get("save"), load=tree.get("load"), tensorboard_dir=tree.get("tensorboard_dir"))
    config.validate()
    return config
