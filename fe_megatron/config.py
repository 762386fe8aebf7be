"""`MemoryConfig`: the single source of truth for a FactorEngram / Engram memory branch.

Every other component (hasher, memory modules, Megatron specs, trainer, parameter
planner) reads its settings from this dataclass; none keeps a copy of its own.

Numbering conventions
---------------------
* ``layers`` are 0-based indices into the backbone's stack of ``num_layers`` blocks,
  the numbering of the paper ("layers 10 and 12 of 24") and of the public Engram code
  (``layer_ids``).  Megatron's 1-based ``layer_number`` is ``index + 1``; the Megatron
  adapter does that conversion in exactly one place.
* Branches are ordered by n-gram order, then by head: for orders ``[1, 2, 3]`` with 4
  heads each, branches 0-3 are the unigram heads, 4-7 bigram, 8-11 trigram.  This fixed
  order aligns the concatenated coefficients ``z`` (Eq. 6) with the dictionary rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

PLACEMENTS = ("before_attn", "before_ffn", "inside_ffn")
GATES = ("basis", "scalar", "none")
REPRESENTATIONS = ("factorized", "dense")


class ConfigError(ValueError):
    """A configuration value is out of its allowed range.

    ``field`` names the offending field; ``where`` (``file:line``) is filled in when the
    value came from a YAML file.
    """

    def __init__(self, field_name: str, message: str, where: Optional[str] = None):
        self.field = field_name
        self.where = where
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}MemoryConfig.{field_name}: {message}")


@dataclass
class MemoryConfig:
    """Settings of one memory branch family (all insertion layers share them).

    Shapes follow the paper: ``s`` = ``coeff_width`` coefficients per position, split
    evenly into ``s_b = s / num_branches`` per branch (Eq. 6); dictionary ``D`` is
    ``s x d_m`` with ``d_m`` = ``memory_dim`` (Sec. 3.1); the backbone width is
    ``d`` = ``hidden_size`` (Eq. 7).
    """

    # --- backbone shape the branch attaches to ---
    vocab_size: int = 32000
    hidden_size: int = 1024
    num_layers: int = 24
    ffn_hidden_size: int = 2816  # SwiGLU width; the output width for placement="inside_ffn"
    # --- addressing (Eq. 1, 6) ---
    ngram_orders: list = field(default_factory=lambda: [1, 2, 3])
    heads_per_order: Union[int, list] = 4
    table_capacity: list = field(default_factory=lambda: [32000, 250_000, 250_000])
    hash_seed: int = 0
    token_compression: Optional[str] = None  # sentencepiece .model file or HF tokenizer dir
    # --- representation and gating (Eq. 6-9, 11) ---
    coeff_width: int = 3072  # s
    memory_dim: int = 3072  # d_m
    representation: str = "factorized"
    gate: str = "basis"
    # --- integration (Eq. 10, 11) ---
    layers: list = field(default_factory=lambda: [10, 12])
    placement: str = "before_attn"
    conv_kernel_size: int = 4
    conv_dilation: int = 3
    # --- objective (Eq. 12, 13) ---
    sparsity_lambda: float = 1e-3
    # --- numerics ---
    norm_eps: float = 1e-5
    init_std: float = 0.02  # Megatron's init_method_std; see docs/method.md "Initialization"

    def __post_init__(self) -> None:
        self.ngram_orders = _int_list("ngram_orders", self.ngram_orders)
        if isinstance(self.heads_per_order, int) and not isinstance(self.heads_per_order, bool):
            self.heads_per_order = [self.heads_per_order] * len(self.ngram_orders)
        self.heads_per_order = _int_list("heads_per_order", self.heads_per_order)
        self.table_capacity = _int_list("table_capacity", self.table_capacity)
        self.layers = _int_list("layers", self.layers)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise `ConfigError` naming the first field whose value is out of range."""
        for name in ("vocab_size", "hidden_size", "num_layers", "ffn_hidden_size",
                     "coeff_width", "memory_dim", "conv_kernel_size", "conv_dilation"):
            _positive_int(name, getattr(self, name))
        _nonneg_int("hash_seed", self.hash_seed)
        orders = self.ngram_orders
        if not orders:
            raise ConfigError("ngram_orders", "is empty; expected e.g. [1, 2, 3]")
        if any(n < 1 for n in orders) or sorted(set(orders)) != orders:
            raise ConfigError("ngram_orders", f"{orders} must be distinct orders >= 1 in increasing order")
        if len(self.heads_per_order) != len(orders):
            raise ConfigError("heads_per_order", f"{self.heads_per_order} has {len(self.heads_per_order)} entries; "
                                                 f"expected one per order in ngram_orders={orders}")
        if any(h < 1 for h in self.heads_per_order):
            raise ConfigError("heads_per_order", f"{self.heads_per_order} must all be >= 1")
        if len(self.table_capacity) != len(orders):
            raise ConfigError("table_capacity", f"{self.table_capacity} has {len(self.table_capacity)} entries; "
                                                f"expected one per order in ngram_orders={orders}")
        for n, cap in zip(orders, self.table_capacity):
            if cap < 2:
                raise ConfigError("table_capacity", f"capacity {cap} for order {n} must be >= 2")
        if 1 in orders and self.token_compression is None:
            cap1 = self.table_capacity[orders.index(1)]
            if cap1 < self.vocab_size:
                raise ConfigError("table_capacity", f"unigram capacity {cap1} is below vocab_size={self.vocab_size}; "
                                                    "unigrams are directly indexed, so it must be >= vocab_size")
        if self.coeff_width % self.num_branches != 0:
            raise ConfigError("coeff_width", f"{self.coeff_width} is not divisible by the {self.num_branches} branches "
                                             f"(orders {orders} x heads {self.heads_per_order}); every branch stores "
                                             "s_b = coeff_width / num_branches coefficients")
        if self.representation not in REPRESENTATIONS:
            raise ConfigError("representation", f"{self.representation!r} is not one of {REPRESENTATIONS}")
        if self.gate not in GATES:
            raise ConfigError("gate", f"{self.gate!r} is not one of {GATES}")
        if self.placement not in PLACEMENTS:
            raise ConfigError("placement", f"{self.placement!r} is not one of {PLACEMENTS}")
        if self.representation == "dense":
            if self.gate == "basis":
                raise ConfigError("gate", "'basis' gates dictionary coefficients and needs representation='factorized'; "
                                          "the dense (Engram) representation supports gate 'scalar' or 'none'")
            if self.memory_dim != self.coeff_width:
                raise ConfigError("memory_dim", f"{self.memory_dim} must equal coeff_width={self.coeff_width} for "
                                                "representation='dense', whose table rows are the memory vectors")
        if not self.layers:
            raise ConfigError("layers", "is empty; expected at least one insertion layer, e.g. [10, 12]")
        for layer in self.layers:
            if not 0 <= layer < self.num_layers:
                raise ConfigError("layers", f"layer {layer} is outside [0, {self.num_layers - 1}] "
                                            f"(0-based indices into num_layers={self.num_layers})")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError("layers", f"{self.layers} lists a layer twice")
        if not (isinstance(self.sparsity_lambda, (int, float)) and math.isfinite(self.sparsity_lambda)
                and self.sparsity_lambda >= 0):
            raise ConfigError("sparsity_lambda", f"{self.sparsity_lambda!r} must be a finite number >= 0")
        for name in ("norm_eps", "init_std"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(name, f"{value!r} must be a finite number > 0")
        if self.token_compression is not None and not isinstance(self.token_compression, str):
            raise ConfigError("token_compression", f"{self.token_compression!r} must be a path string or null")

    # ------------------------------------------------------------------ derived shapes
    @property
    def branch_orders(self) -> list:
        """n-gram order of each branch, in the fixed branch order (Eq. 6)."""
        return [n for n, heads in zip(self.ngram_orders, self.heads_per_order) for _ in range(heads)]

    @property
    def num_branches(self) -> int:
        return sum(self.heads_per_order)

    @property
    def branch_width(self) -> int:
        """s_b: coefficients (or, for dense tables, embedding width) stored per branch."""
        return self.coeff_width // self.num_branches

    @property
    def output_size(self) -> int:
        """Width of the memory output m_t: d, or the SwiGLU width for inside-FFN insertion."""
        return self.ffn_hidden_size if self.placement == "inside_ffn" else self.hidden_size

    @property
    def max_order(self) -> int:
        return max(self.ngram_orders)

    # ------------------------------------------------------------------ construction
    @classmethod
    def preset_names(cls) -> list:
        from fe_megatron.presets import PRESETS

        return sorted(PRESETS)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "MemoryConfig":
        from fe_megatron.presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available presets: {', '.join(sorted(PRESETS))}")
        values = dict(PRESETS[name])
        values.update(overrides)
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict, where: Optional[dict] = None) -> "MemoryConfig":
        """Build from a plain dict. ``where`` maps field names to ``file:line`` for error messages."""
        where = where or {}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            key = unknown[0]
            raise ConfigError(key, f"unknown field (known fields: {', '.join(sorted(known))})", where.get(key))
        try:
            return cls(**values)
        except ConfigError as err:
            if err.where is None and err.field in where:
                raise ConfigError(err.field, str(err).split(": ", 1)[1], where[err.field]) from None
            raise

    @classmethod
    def from_yaml(cls, path: Union[str, Path], key: Optional[str] = None) -> "MemoryConfig":
        """Load from YAML. With ``key``, read the mapping under that top-level key (e.g. ``memory``).

        A ``preset: NAME`` entry starts from that preset; the other entries override it.
        Errors name the file and line of the offending entry.
        """
        import yaml

        path = Path(path)
        text = path.read_text()
        try:
            root = yaml.compose(text)
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: invalid YAML: {err}") from None
        if key is not None:
            if not isinstance(data, dict) or key not in data:
                raise ValueError(f"{path}: no top-level '{key}' mapping")
            root = next(v for k, v in root.value if k.value == key)
            data = data[key]
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of MemoryConfig fields, got {type(data).__name__}")
        where = {k.value: f"{path}:{k.start_mark.line + 1}" for k, _ in root.value}
        preset = data.pop("preset", None)
        if preset is not None:
            from fe_megatron.presets import PRESETS

            if preset not in PRESETS:
                raise ValueError(f"{where['preset']}: unknown preset {preset!r}; available: {', '.join(sorted(PRESETS))}")
            data = {**PRESETS[preset], **data}
        return cls.from_dict(data, where)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "MemoryConfig":
        return dataclasses.replace(self, **changes)


def _int_list(name: str, value: Any) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(name, f"{value!r} must be a list of integers")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(name, f"{value!r} must be a list of integers; {item!r} is a {type(item).__name__}")
        out.append(int(item))
    return out


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, f"{value!r} must be an integer >= 1")


def _nonneg_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(name, f"{value!r} must be an integer >= 0")
