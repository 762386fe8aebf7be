"""The configuration of the backbone and of its memory branches.

* `BackboneConfig`: the Llama-style Transformer (RoPE, RMSNorm, SwiGLU, no biases) that the
  memory attaches to.  It is written once: the ``model:`` section of a training config, or a
  named backbone (``BACKBONES``).  Megatron's ``TransformerConfig``, the Hugging Face config and
  the parameter planner are all built from it.
* `MemoryConfig`: the single source of truth for the memory branch.  It holds its backbone
  (``config.backbone``) and reads the backbone's width, depth, vocabulary, FFN width,
  normalization epsilon and init std from there, so none of them is ever written twice.

Numbering conventions
---------------------
* ``layers`` are 0-based indices into the backbone's stack of ``num_layers`` blocks.  The paper
  gives its insertion layers as a list, ``[10, 12]`` (Table 8), in the same form as DeepSeek's
  public Engram code gives its ``layer_ids`` (``[1, 15]``), which are 0-based indices into the
  list of blocks; fe_megatron reads the paper's list the same way.  Megatron's 1-based
  ``layer_number`` is ``index + 1`` (the paper's layers 10 and 12 are Megatron layers 11 and 13);
  `fe_megatron.megatron.transformer_layer` converts in exactly one place.  Everywhere else in
  fe_megatron a 0-based index is called ``layer_index``.
* Branches are ordered by n-gram order, then by head: for orders ``[1, 2, 3]`` with 4 heads
  each, branches 0-3 are the unigram heads, 4-7 bigram, 8-11 trigram.  This fixed order aligns
  the concatenated coefficients ``z`` (Eq. 6) with the dictionary rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from fe_megatron.suggest import did_you_mean, unknown_name

PLACEMENTS = ("before_attn", "before_ffn", "inside_ffn")
GATES = ("basis", "scalar", "none")
MEMORY_KINDS = ("factorengram", "engram")
# How the tables are stored (`fe_megatron.tables.storage`): fp32 and bf16 train; fp8 is for serving.
TABLE_DTYPES = ("fp32", "bf16", "fp8")
# Where a process keeps its tables (`fe_megatron.tables.store`): in accelerator memory, or in host
# memory with the rows each microbatch needs copied over ahead of use (docs/tables.md).
TABLE_PLACEMENTS = ("device", "host")
BACKBONE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                   "ffn_hidden_size",
                   "seq_length", "init_std", "norm_eps", "rope_base", "tie_embeddings", "dropout")


class ConfigError(ValueError):
    """A configuration value is out of its allowed range.

    ``field`` names the offending field inside ``section`` (``MemoryConfig``, ``BackboneConfig``,
    or a training-config section such as ``optimizer``); ``path`` is ``section.field``.
    ``where`` (``file:line``) is filled in when the value came from a YAML file.
    """

    def __init__(self, field_name: str, message: str, where: Optional[str] = None,
                 section: Optional[str] = "MemoryConfig"):
        self.field = field_name
        self.detail = message
        self.where = where
        self.section = section
        self.path = f"{section}.{field_name}" if section else field_name
        super().__init__(f"{where + ': ' if where else ''}{self.path}: {message}")

    def relocated(self, section: Optional[str], where: Optional[str] = None) -> "ConfigError":
        """The same error reported under another section (and, if given, another ``file:line``)."""
        return ConfigError(self.field, self.detail, where or self.where, section)


@dataclass
class BackboneConfig:
    """The backbone Transformer: pre-norm RMSNorm, RoPE, SwiGLU FFN, no biases (Sec. 4.1, Table 8)."""

    vocab_size: int = 32000  # the embedding rows; must be >= the tokenizer's vocabulary
    hidden_size: int = 1024  # d
    num_layers: int = 24
    num_attention_heads: int = 16
    num_query_groups: Optional[int] = None  # key/value heads (grouped-query attention); None = one per head
    ffn_hidden_size: int = 2816  # SwiGLU width (8/3 d rounded up to a multiple of 256)
    seq_length: int = 8192  # training context (and RoPE's maximum position)
    init_std: float = 0.02  # Megatron's init_method_std: every weight matrix, the memory's Q and key too
    norm_eps: float = 1e-5  # every RMSNorm, the memory's too
    rope_base: float = 10000.0
    tie_embeddings: bool = True  # input embedding and output layer share their weight
    dropout: float = 0.0  # hidden and attention dropout (the paper's runs use none)
    # a mixture-of-experts FFN in every layer (the Megatron engine only): 0 keeps the dense SwiGLU FFN; each
    # expert is a SwiGLU of ffn_hidden_size, moe_router_topk of them per token, Megatron's load-balancing loss
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.01
    # megatron-core's HybridModel instead of the GPT model (the Megatron engine, megatron-core 0.19 on): one
    # symbol per layer, '*' attention, '-' MLP (dense SwiGLU), 'E' MoE (num_experts); num_layers counts its
    # attention layers (the GPT model's blocks, which memory.layers index). None: the GPT model
    hybrid_layer_pattern: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                     "seq_length"):
            _positive_int(name, getattr(self, name), "BackboneConfig")
        for name in ("init_std", "norm_eps", "rope_base"):
            _positive_float(name, getattr(self, name), "BackboneConfig")
        if isinstance(self.dropout, bool) or not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ConfigError("dropout", f"{self.dropout!r} must be a number in [0, 1)", section="BackboneConfig")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError("tie_embeddings", f"{self.tie_embeddings!r} must be true or false",
                              section="BackboneConfig")
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ConfigError("num_experts", f"{self.num_experts!r} must be an integer >= 0 (0: a dense FFN)",
                              section="BackboneConfig")
        if self.num_experts:
            _positive_int("moe_router_topk", self.moe_router_topk, "BackboneConfig")
            if self.moe_router_topk > self.num_experts:
                raise ConfigError("moe_router_topk", f"{self.moe_router_topk} exceeds num_experts={self.num_experts}",
                                  section="BackboneConfig")
            if isinstance(self.moe_aux_loss_coeff, bool) or not (
                    isinstance(self.moe_aux_loss_coeff, (int, float)) and self.moe_aux_loss_coeff >= 0):
                raise ConfigError("moe_aux_loss_coeff", f"{self.moe_aux_loss_coeff!r} must be a number >= 0",
                                  section="BackboneConfig")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("num_attention_heads", f"{self.num_attention_heads} does not divide hidden_size="
                                                     f"{self.hidden_size}", section="BackboneConfig")
        if self.hybrid_layer_pattern is not None:
            self._check_hybrid_layer_pattern()
        if self.num_query_groups is not None:
            _positive_int("num_query_groups", self.num_query_groups, "BackboneConfig")
            if self.num_attention_heads % self.num_query_groups:
                raise ConfigError("num_query_groups", f"{self.num_query_groups} does not divide num_attention_heads="
                                                      f"{self.num_attention_heads}", section="BackboneConfig")

    def _check_hybrid_layer_pattern(self) -> None:
        from fe_megatron.hybrid_pattern import ATTENTION, KINDS, MLP, MOE, attention_layers, layers_of

        pattern = self.hybrid_layer_pattern
        if not isinstance(pattern, str) or not layers_of(pattern):
            raise ConfigError("hybrid_layer_pattern", f"{pattern!r} must be a string of layer symbols, e.g. '*-*-*-*-'",
                              section="BackboneConfig")
        others = sorted(set(layers_of(pattern)) - {ATTENTION, MLP, MOE})
        if others:
            kinds = ", ".join(f"{symbol!r} ({KINDS.get(symbol, 'not a layer symbol')})" for symbol in others)
            raise ConfigError("hybrid_layer_pattern", f"{pattern!r}: {kinds} not built by fe-pretrain, whose hybrid "
                                                      "stack has '*' attention, '-' MLP and 'E' MoE layers "
                                                      "(pipeline splits: parallel.pipeline)", section="BackboneConfig")
        if MOE in pattern and not self.num_experts:
            raise ConfigError("hybrid_layer_pattern", f"{pattern!r} has MoE ('E') layers; set num_experts",
                              section="BackboneConfig")
        attention = len(attention_layers(pattern))
        if self.num_layers != attention:
            raise ConfigError("num_layers", f"{self.num_layers} must count hybrid_layer_pattern {pattern!r}'s "
                                            f"attention ('*') layers: {attention}", section="BackboneConfig")

    @classmethod
    def from_dict(cls, values: dict, where: Optional[dict] = None) -> "BackboneConfig":
        """Fields, or ``preset: NAME`` (one of ``BACKBONES``) plus overrides."""
        from fe_megatron.presets import BACKBONES

        return _build(cls, apply_preset(values, BACKBONES, "backbone", where, "BackboneConfig"), where or {},
                      "BackboneConfig")


@dataclass
class MemoryConfig:
    """Settings of one memory family (all insertion layers share them).

    Shapes follow the paper: ``s`` = ``coeff_width`` coefficients per position, split evenly
    into ``s_b = s / num_branches`` per branch (Eq. 6); dictionary ``D`` is ``s x d_m`` with
    ``d_m`` = ``memory_dim`` (Sec. 3.1); the backbone width is ``d`` = ``backbone.hidden_size``
    (Eq. 7).  ``kind`` picks the branch: ``factorengram`` (coefficients over a dictionary,
    Eq. 6-10) or ``engram`` (DeepSeek's dense hashed embeddings with one scalar gate).
    """

    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    kind: str = "factorengram"
    # --- addressing (Eq. 1, 6) ---
    ngram_orders: list = field(default_factory=lambda: [1, 2, 3])
    heads_per_order: Union[int, list] = 4
    table_capacity: list = field(default_factory=lambda: [32000, 250_000, 250_000])
    hash_seed: int = 0
    token_compression: Optional[str] = None  # sentencepiece .model file or HF tokenizer dir
    # --- representation and gating (Eq. 6-9, 14) ---
    coeff_width: int = 3072  # s
    memory_dim: int = 3072  # d_m
    gate: str = "basis"
    # --- integration (Eq. 10, 11) ---
    layers: list = field(default_factory=lambda: [10, 12])
    placement: str = "before_attn"
    conv_kernel_size: int = 4
    conv_dilation: int = 3
    # --- objective (Eq. 12, 13) ---
    sparsity_lambda: float = 1e-3
    # --- initialization (docs/method.md) ---
    table_init_std: float = 1.0  # the tables' rows: N(0, table_init_std^2), as nn.Embedding
    # --- storage (docs/tables.md) ---
    table_dtype: str = "fp32"  # fp32 | bf16 (both train; bf16 updates stochastically rounded) | fp8 (serving)
    table_placement: str = "device"  # device | host (the host tier: rows fetched ahead of use; docs/tables.md)

    def __post_init__(self) -> None:
        if not isinstance(self.backbone, BackboneConfig):
            raise ConfigError("backbone", f"{self.backbone!r} must be a BackboneConfig")
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
        for name in ("coeff_width", "memory_dim", "conv_kernel_size", "conv_dilation"):
            _positive_int(name, getattr(self, name))
        _nonneg_int("hash_seed", self.hash_seed)
        if self.kind not in MEMORY_KINDS:
            raise ConfigError("kind", f"{self.kind!r} is not one of {MEMORY_KINDS}")
        self._check_addressing()
        self._check_integration()
        if not (isinstance(self.sparsity_lambda, (int, float)) and math.isfinite(self.sparsity_lambda)
                and self.sparsity_lambda >= 0):
            raise ConfigError("sparsity_lambda", f"{self.sparsity_lambda!r} must be a finite number >= 0")
        _positive_float("table_init_std", self.table_init_std)
        if self.table_dtype not in TABLE_DTYPES:
            raise ConfigError("table_dtype", f"{self.table_dtype!r} is not one of {TABLE_DTYPES}")
        if self.table_placement not in TABLE_PLACEMENTS:
            raise ConfigError("table_placement", f"{self.table_placement!r} is not one of {TABLE_PLACEMENTS}")
        if self.table_dtype == "fp8" and self.table_placement != "device":
            raise ConfigError("table_placement", f"{self.table_placement!r} with table_dtype 'fp8': fp8 tables are a "
                                                 "serving format, held where the model is (table_placement: device)")
        if self.token_compression is not None and not isinstance(self.token_compression, str):
            raise ConfigError("token_compression", f"{self.token_compression!r} must be a path string or null")

    def _check_addressing(self) -> None:
        """The n-gram orders, heads and table capacities, and that every branch gets as many coefficients."""
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
        if self.token_compression is None:  # with compression the hasher checks once it has loaded the tokenizer
            self.check_unigram_capacity(self.vocab_size)
        if self.coeff_width % self.num_branches != 0:
            raise ConfigError("coeff_width", f"{self.coeff_width} is not divisible by the {self.num_branches} branches "
                                             f"(orders {orders} x heads {self.heads_per_order}); every branch stores "
                                             "s_b = coeff_width / num_branches coefficients")

    def _check_integration(self) -> None:
        """The gate, where the branch joins the block (Engram's constraints included) and the insertion layers."""
        if self.gate not in GATES:
            raise ConfigError("gate", f"{self.gate!r} is not one of {GATES}")
        if self.placement not in PLACEMENTS:
            raise ConfigError("placement", f"{self.placement!r} is not one of {PLACEMENTS}")
        if self.kind == "engram":
            if self.gate == "basis":
                raise ConfigError("gate", "'basis' gates dictionary coefficients and needs kind='factorengram'; "
                                          "Engram's dense tables support gate 'scalar' or 'none'")
            if self.memory_dim != self.coeff_width:
                raise ConfigError("memory_dim", f"{self.memory_dim} must equal coeff_width={self.coeff_width} for "
                                                "kind='engram', whose table rows are the memory vectors")
        if not self.layers:
            raise ConfigError("layers", "is empty; expected at least one insertion layer, e.g. [10, 12]")
        for layer in self.layers:
            if not 0 <= layer < self.num_layers:
                raise ConfigError("layers", f"layer {layer} is outside [0, {self.num_layers - 1}] "
                                            f"(0-based indices into num_layers={self.num_layers})")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError("layers", f"{self.layers} lists a layer twice")

    # ------------------------------------------------------------------ the backbone's fields
    @property
    def vocab_size(self) -> int:
        return self.backbone.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @property
    def num_layers(self) -> int:
        return self.backbone.num_layers

    @property
    def ffn_hidden_size(self) -> int:
        return self.backbone.ffn_hidden_size

    @property
    def norm_eps(self) -> float:
        return self.backbone.norm_eps

    @property
    def init_std(self) -> float:
        return self.backbone.init_std

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
        """s_b: coefficients (or, for Engram, embedding width) stored per branch."""
        return self.coeff_width // self.num_branches

    @property
    def output_size(self) -> int:
        """Width of the memory output m_t: d, or the SwiGLU width for inside-FFN insertion."""
        return self.ffn_hidden_size if self.placement == "inside_ffn" else self.hidden_size

    @property
    def max_order(self) -> int:
        return max(self.ngram_orders)

    # ------------------------------------------------------------------ construction
    def check_unigram_capacity(self, lookup_vocab: int) -> None:
        """Unigrams are indexed directly: the unigram table needs a row for each of the ``lookup_vocab``
        ids the addressing sees (``vocab_size``, or the compressed vocabulary with token compression)."""
        if 1 not in self.ngram_orders:
            return
        cap1 = self.table_capacity[self.ngram_orders.index(1)]
        if cap1 < lookup_vocab:
            seen = (f"vocab_size={lookup_vocab}" if self.token_compression is None
                    else f"the lookup vocabulary ({lookup_vocab} ids after token compression)")
            raise ConfigError("table_capacity", f"unigram capacity {cap1} is below {seen}; unigrams are directly "
                                                f"indexed, so it must be >= {lookup_vocab}")

    @classmethod
    def preset_names(cls) -> list:
        from fe_megatron.presets import PRESETS

        return sorted(PRESETS)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "MemoryConfig":
        return cls.from_dict({"preset": name, **overrides})

    @classmethod
    def from_dict(cls, values: dict, where: Optional[dict] = None,
                  backbone: Optional[BackboneConfig] = None) -> "MemoryConfig":
        """Build from a plain dict, the one path every preset, YAML file and training config takes.

        ``preset: NAME`` starts from that preset (`fe_megatron.presets`) and the other entries
        override it.  ``backbone`` is a `BackboneConfig`, a dict of its fields, or the name of
        one of ``BACKBONES``; a ``backbone`` argument replaces it (the training config passes
        its ``model:`` section).  ``where`` maps field names to ``file:line`` for error messages.
        """
        from fe_megatron.presets import BACKBONES, PRESETS

        where = where or {}
        values = apply_preset(values, PRESETS, "memory", where, "MemoryConfig")
        misplaced = sorted(set(values) & set(BACKBONE_FIELDS))
        if misplaced:
            raise ConfigError(misplaced[0], "is a backbone field: set it in the backbone (the training config's "
                                            "model section, or MemoryConfig.backbone), not in the memory",
                              _line(where.get(misplaced[0])))
        if backbone is not None:
            values["backbone"] = backbone
        spec = values.get("backbone", BackboneConfig())
        if isinstance(spec, str):
            if spec not in BACKBONES:
                raise ConfigError("backbone", f"unknown backbone {spec!r}{did_you_mean(spec, BACKBONES)} "
                                              f"(available: {', '.join(sorted(BACKBONES))})",
                                  _line(where.get("backbone")))
            spec = {"preset": spec}
        if isinstance(spec, dict):
            nested = where.get("backbone")
            try:
                spec = BackboneConfig.from_dict(spec, nested if isinstance(nested, dict) else None)
            except ConfigError as err:
                raise err.relocated("MemoryConfig.backbone") from None
        values["backbone"] = spec
        return _build(cls, values, where, "MemoryConfig")

    @classmethod
    def from_yaml(cls, path: Union[str, Path], key: Optional[str] = None, backbone: Optional[BackboneConfig] = None,
                  **overrides: Any) -> "MemoryConfig":
        """Load from YAML: a mapping of fields, or (with ``key``, or when the file has a ``memory:``
        section, as a training config does) the mapping under that top-level key.  In a training
        config the backbone is its ``model:`` section; a ``backbone`` argument replaces the file's, and
        ``overrides`` replace its fields.  Errors name the file and line."""
        top, top_where = read_yaml_mapping(path)
        backbone_argument = backbone
        data, where, backbone = top, top_where, None
        if key is None and isinstance(top.get("memory"), dict):
            key = "memory"
        if key is not None:
            if key not in top:
                raise ValueError(f"{path}: no top-level '{key}' mapping")
            data, where = top[key], top_where[key]
            if isinstance(top.get("model"), dict):
                backbone = BackboneConfig.from_dict(top["model"], top_where["model"])
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of MemoryConfig fields, got {type(data).__name__}")
        return cls.from_dict({**data, **overrides}, where, backbone=backbone_argument or backbone)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "MemoryConfig":
        return dataclasses.replace(self, **changes)


def apply_preset(values: dict, presets: dict, what: str, where: Optional[dict], section: str) -> dict:
    """``values`` with a ``preset: NAME`` entry expanded: the preset's fields, overridden by the rest."""
    values = dict(values)
    name = values.pop("preset", None)
    if name is None:
        return values
    if name not in presets:
        raise ConfigError("preset", f"unknown {what} preset {name!r}{did_you_mean(name, presets)} "
                                    f"(available: {', '.join(sorted(presets))})",
                          (where or {}).get("preset"), section)
    return {**presets[name], **values}


def yaml_loader():
    """PyYAML's safe loader reading ``1e-2`` as a number, as YAML 1.2 does (PyYAML follows YAML 1.1,
    which wants ``1.0e-2`` and would hand the optimizer a string)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
        r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
    return Loader


def load_yaml(text: str):
    import yaml

    return yaml.load(text, Loader=yaml_loader())


def read_yaml_mapping(path: Union[str, Path]):
    """``(data, where)``: a YAML file's top-level mapping and, for every key (recursively), its
    ``file:line`` (a nested mapping's ``where`` is a dict of the same form)."""
    import yaml

    path = Path(path)
    text = path.read_text()
    try:
        root = yaml.compose(text, Loader=yaml_loader())
        data = load_yaml(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: invalid YAML: {err}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")

    def lines(node):
        out = {}
        for key, value in node.value:
            out[key.value] = lines(value) if isinstance(value, yaml.MappingNode) else f"{path}:{key.start_mark.line + 1}"
        return out

    return data, lines(root)


def _build(cls, values: dict, where: dict, section: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        key = unknown[0]
        raise ConfigError(key, unknown_name("field", key, known), _line(where.get(key)), section)
    try:
        return cls(**values)
    except ConfigError as err:
        if err.where is None and err.field in where:
            raise err.relocated(err.section, _line(where[err.field])) from None
        raise


def _line(where_entry) -> Optional[str]:
    """A key's ``file:line``; for a nested mapping, that of its first key."""
    while isinstance(where_entry, dict):
        where_entry = next(iter(where_entry.values()), None)
    return where_entry


def _int_list(name: str, value: Any) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(name, f"{value!r} must be a list of integers")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(name, f"{value!r} must be a list of integers; {item!r} is a {type(item).__name__}")
        out.append(int(item))
    return out


def _positive_int(name: str, value: Any, section: str = "MemoryConfig") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, f"{value!r} must be an integer >= 1", section=section)


def _nonneg_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(name, f"{value!r} must be an integer >= 0")


def _positive_float(name: str, value: Any, section: str = "MemoryConfig") -> None:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(name, f"{value!r} must be a finite number > 0", section=section)
