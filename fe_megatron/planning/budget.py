"""Parameter budget of a configuration, computed from shapes alone (nothing is allocated).

Backbone assumptions (the paper's Llama-style Transformer): attention with Q and output
projections of d x d and K, V projections of d x (query groups x head width), SwiGLU FFN of width ``ffn_hidden_size``
(three d x f matrices; with ``num_experts`` one such FFN per expert and a d x experts router),
two RMSNorms per layer plus a final one, no biases, tied input and output embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fe_megatron.config import MemoryConfig
from fe_megatron.ngram.hashing import branch_layouts


def layer_params(config: MemoryConfig) -> int:
    """One Transformer layer of the backbone, memory excluded."""
    backbone = config.backbone
    d, f = backbone.hidden_size, backbone.ffn_hidden_size
    key_value_width = d // backbone.num_attention_heads * (backbone.num_query_groups or backbone.num_attention_heads)
    experts = backbone.num_experts
    ffn = experts * 3 * d * f + d * experts if experts else 3 * d * f
    return 2 * d * d + 2 * d * key_value_width + ffn + 2 * d


def backbone_params(config: MemoryConfig) -> int:
    return config.vocab_size * config.hidden_size + config.num_layers * layer_params(config) + config.hidden_size


@dataclass
class LayerBudget:
    layer: int
    tables_per_order: dict = field(default_factory=dict)  # order -> parameters (all heads)
    dense: dict = field(default_factory=dict)  # dictionary / projections / norms / conv

    @property
    def tables(self) -> int:
        return sum(self.tables_per_order.values())

    @property
    def total(self) -> int:
        return self.tables + sum(self.dense.values())


def memory_layer_budget(config: MemoryConfig, layer: int) -> LayerBudget:
    layout = branch_layouts(config)[layer]
    budget = LayerBudget(layer)
    for order, rows in zip(layout.orders, layout.moduli):
        budget.tables_per_order[order] = budget.tables_per_order.get(order, 0) + rows * config.branch_width
    d, s, dm, out = config.hidden_size, config.coeff_width, config.memory_dim, config.output_size
    if config.kind == "factorengram":
        budget.dense["dictionary"] = s * dm
        if config.gate != "none":
            budget.dense["query_proj"] = d * dm
            budget.dense["query_norm"] = dm
    elif config.gate == "scalar":
        budget.dense["key_proj"] = s * d
        budget.dense["key_norm+query_norm"] = 2 * d
    budget.dense["value_proj"] = dm * out
    budget.dense["conv"] = out * config.conv_kernel_size + out
    return budget


def format_budget(config: MemoryConfig, name: str = "") -> str:
    """Human-readable budget; the last line is ``total_params=<int>``."""
    lines = [f"# parameter budget{' of ' + name if name else ''}"]
    backbone = backbone_params(config)
    lines.append(f"backbone_params={backbone}  ({backbone / 1e6:.1f}M)")
    memory_total = table_total = 0
    for layer in config.layers:
        lb = memory_layer_budget(config, layer)
        for order, count in sorted(lb.tables_per_order.items()):
            lines.append(f"layer {layer}: tables order {order} ({config.heads_per_order[config.ngram_orders.index(order)]}"
                         f" heads) = {count}  ({count / 1e6:.1f}M)")
        for part, count in lb.dense.items():
            lines.append(f"layer {layer}: {part} = {count}  ({count / 1e6:.2f}M)")
        memory_total += lb.total
        table_total += lb.tables
    lines.append(f"table_params={table_total}  ({table_total / 1e9:.3f}B)")
    lines.append(f"memory_dense_params={memory_total - table_total}  ({(memory_total - table_total) / 1e6:.1f}M)")
    stored = serving_table_bytes(config)
    lines.append("tables stored for serving (fe-convert --table-dtype): "
                 + " | ".join(f"{dtype} {size / 2 ** 30:.2f} GiB" for dtype, size in stored.items())
                 + " (fp8: e4m3 plus one fp32 scale per row)")
    total = backbone + memory_total
    lines.append(f"# total {total / 1e9:.3f}B")
    lines.append(f"total_params={total}")
    return "\n".join(lines)


def serving_table_bytes(config: MemoryConfig) -> dict:
    """``{table_dtype: bytes}`` of all tables stored in each format (`fe_megatron.tables.storage`)."""
    tables = sum(memory_layer_budget(config, layer).tables for layer in config.layers)
    rows = tables // config.branch_width
    return {"fp32": 4 * tables, "bf16": 2 * tables, "fp8": tables + 4 * rows}


def total_params(config: MemoryConfig) -> int:
    return backbone_params(config) + sum(memory_layer_budget(config, layer).total for layer in config.layers)
