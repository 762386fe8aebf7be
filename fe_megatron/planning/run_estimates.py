"""What a planner of a run wants beside the per-rank weights and optimizer state: activation memory
at the configured sequence length, micro-batch and recompute, the checkpoint's size on disk, and
the bytes each rank communicates per step.  Estimates from shapes alone (fe-plan prints them).

Activations (bytes per rank, the heaviest pipeline stage), after Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (2022), Sec. 4, with 16-bit activations:

* a backbone layer without recompute keeps ``s b h (34 + 5 a s / h)`` bytes, divided by ``t`` under
  tensor parallelism with sequence parallelism (``10 + 24 / t`` instead of 34 without it); the
  ``5 a s / h`` term is the unfused attention's scores and is absent with Transformer Engine's
  fused attention; fp32 activations (CPU runs) take twice as much;
* under full recompute a layer keeps only its input, ``2 s b h / t`` bytes, and the layer being
  recomputed holds its full activations once;
* a memory layer adds per token its gathered coefficients, gate and gated coefficients
  (``3 s / t`` values), the query and reconstruction (``2 d_m``) and the value, convolution and
  output (``3 d``);
* 1F1B pipelining keeps up to ``pp`` microbatches in flight on the first stage;
* the last stage holds the logits in fp32 for the loss: ``4 s b V / t``.

The estimate is meant to within about a third; a measured peak (``memory_mb`` in metrics.jsonl)
is the figure to trust once a few steps have run.
"""

from __future__ import annotations

from fe_megatron.config import MemoryConfig
from fe_megatron.memory.sharding import ROW_SHARDINGS, pipeline_stage_layers
from fe_megatron.planning.budget import backbone_params, memory_layer_budget, total_params
from fe_megatron.planning.rank_memory import DTYPE_BYTES, TableStorage, rank_memory

GIB = 2 ** 30


def activation_bytes(config: MemoryConfig, tp: int, pp: int, micro_batch_size: int, seq_length: int,
                     precision: str, recompute: str, microbatches: int, sequence_parallel: bool = True,
                     fused_attention: bool = False) -> float:
    """Activation bytes of the pipeline stage that holds the most (see the module docstring)."""
    s, b, h, a = seq_length, micro_batch_size, config.hidden_size, config.backbone.num_attention_heads
    scale = 1.0 if precision == "bf16" else 2.0
    attention_scores = 0.0 if fused_attention else 5 * a * s / h
    per_layer_full = s * b * h * ((34 / tp if sequence_parallel else 10 + 24 / tp) + attention_scores / tp) * scale
    memory_per_layer = s * b * (3 * config.coeff_width / tp + 2 * config.memory_dim + 3 * h) * 2 * scale
    worst = 0.0
    for stage in range(pp):
        layers = pipeline_stage_layers(config.num_layers, pp, stage)
        memory_layers = sum(1 for layer in config.layers if layer in layers)
        if recompute == "full":
            held = len(layers) * 2 * s * b * h / tp * scale + per_layer_full + memory_per_layer * min(memory_layers, 1)
        else:
            held = len(layers) * per_layer_full + memory_layers * memory_per_layer
        in_flight = min(pp - stage, microbatches)  # 1F1B: stage i holds pp - i microbatches
        total = held * in_flight
        if stage == pp - 1:
            total += 4 * s * b * config.vocab_size / tp
        worst = max(worst, total)
    return worst


def checkpoint_bytes(config: MemoryConfig, precision: str, storage: TableStorage) -> float:
    """One checkpoint on disk, all ranks together: weights in their training dtype, an fp32 master copy
    of bf16 weights and Adam's two fp32 moments; the tables in their dtype with their state's moments."""
    table_params = total_params(config) - backbone_params(config) - sum(
        sum(memory_layer_budget(config, layer).dense.values()) for layer in config.layers)
    rest = total_params(config) - table_params
    rest_bytes = rest * ((2 + 4) if precision == "bf16" else 4) + rest * 8
    state = storage.plan(precision).state_bytes_per_parameter(config.branch_width)
    table_bytes = table_params * (DTYPE_BYTES[storage.table_dtype] + state)
    return rest_bytes + table_bytes


def gradient_communication_bytes(config: MemoryConfig, tp: int, pp: int, dp: int, table_sharding: str,
                                 distributed_optimizer: bool, precision: str, storage: TableStorage) -> float:
    """Bytes one rank sends per step for the data-parallel gradient reduction (a ring all-reduce of fp32
    gradients, or the distributed optimizer's reduce-scatter plus its all-gather of the updated
    weights), whole tables included; row-sharded tables move in the row exchange instead."""
    if dp == 1:
        return 0.0
    m = rank_memory(config, tp, pp, dp, table_sharding, distributed_optimizer, precision, storage)
    rest_params = m.rest_grads / 4
    gradients = m.rest_grads + (0.0 if table_sharding in ROW_SHARDINGS else m.table_grads)
    ring = (dp - 1) / dp
    if distributed_optimizer:
        weight_bytes = 2 if precision == "bf16" else 4
        return ring * gradients + ring * rest_params * weight_bytes
    return 2 * ring * gradients


def format_run_estimates(config: MemoryConfig, tp: int, pp: int, dp: int, table_sharding: str,
                         distributed_optimizer: bool, precision: str, micro_batch_size: int, seq_length: int,
                         global_batch_size: int, storage: TableStorage, recompute: str, keep_checkpoints: int,
                         saves: int | None, device_gib: float, sequence_parallel: bool = False,
                         fused_attention: bool = False) -> str:
    microbatches = global_batch_size // (micro_batch_size * dp)
    activations = activation_bytes(config, tp, pp, micro_batch_size, seq_length, precision, recompute, microbatches,
                                   sequence_parallel, fused_attention)
    m = rank_memory(config, tp, pp, dp, table_sharding, distributed_optimizer, precision, storage)
    device = m.device + activations
    fits = "yes" if device <= device_gib * GIB else "no"
    checkpoint = checkpoint_bytes(config, precision, storage)
    if keep_checkpoints:
        disk = f"{keep_checkpoints * checkpoint / GIB:.1f} GiB for the {keep_checkpoints} kept (training.keep_checkpoints)"
    elif saves:
        disk = f"{saves * checkpoint / GIB:.1f} GiB for all {saves} the run writes (training.keep_checkpoints: 0)"
    else:
        disk = "one per save, all kept (training.keep_checkpoints: 0)"
    communication = gradient_communication_bytes(config, tp, pp, dp, table_sharding, distributed_optimizer, precision,
                                                 storage)
    stage = " (the heaviest pipeline stage)" if pp > 1 else ""
    return "\n".join([
        f"activations per rank{stage}: about {activations / GIB:.2f} GiB (micro-batch {micro_batch_size} x "
        f"{seq_length} tokens, recompute {recompute}, {microbatches} microbatch(es) per step, "
        f"{'fused' if fused_attention else 'unfused'} attention; fe_megatron/planning/run_estimates.py says how); "
        "device total with them "
        f"{device / GIB:.2f} GiB, fits {device_gib:g} GiB: {fits}",
        f"checkpoint on disk: {checkpoint / GIB:.2f} GiB each; {disk}",
        f"data-parallel gradient traffic per step and rank: {communication / GIB:.2f} GiB sent"
        + (" (whole tables included)" if table_sharding not in ROW_SHARDINGS and dp > 1 else "")])
