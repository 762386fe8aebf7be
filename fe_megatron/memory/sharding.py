"""The sharding plan: for every memory parameter, how the parallel layouts split it.

This table is the one place that says it.  Building a branch (its local shapes, `local_shape`), the Megatron
parallel attributes and ``sharded_state_dict`` (`fe_megatron.megatron.memory_layer`), and any
conversion between a single-process state dict and tensor-parallel shards all read it.  A new
parameter, or a new split, is an edit of `SHARDING_PLAN` and nothing else; a test checks that
every parameter of every branch variant has an entry.

Every parameter has one global shape at every layout (the shape a single process holds), and
the same name.  Splits:

* ``tensor_parallel_dim``: the axis split into ``tp`` equal contiguous slices, rank ``r`` holding
  slice ``r``.  The tables are split by columns, and every tensor indexed by the coefficient
  axis with them: FactorEngram's dictionary ``[branches, s_b, d_m]`` (D viewed per branch) and
  Engram's projections ``[out, branches, s_b]``, so each rank's coefficients meet their own rows
  of D.  ``None``: whole on every tensor-parallel rank.  Those parameters see only the rank's
  own tokens under sequence parallelism, so their gradients are summed over the TP group.
* ``row_parallel``: with row sharding on (``parallel.table_sharding: rows`` or ``node``), the rows are split
  over the memory-parallel group, per branch, as `fe_megatron.tables.row_exchange.RowPartition`
  says; lookups then go through the all-to-all row exchange.  This composes with the column
  split: a rank holds about ``rows / N x columns / tp``.
* ``is_table``: an n-gram table (learning-rate and weight-decay multipliers, `docs/training.md`).

The rationale for the split is in docs/parallelism.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# the rows split over the row group, each row with one owner rank: the table plan's vocabulary
from fe_megatron.tables.plan import NODE_SHARED, ROW_SHARDED, ROW_SHARDINGS  # noqa: F401 (re-exported)

# ``parallel.table_sharding``: where the tables' rows live, across data-parallel ranks.
TABLE_SHARDINGS = {
    "replicated": "every data-parallel rank holds every row (gradients all-reduced, as for any weight)",
    "rows": "the rows are split over the memory-parallel group (the data-parallel ranks, times the context-parallel "
            "ones); the row exchange fetches what each microbatch needs",
    "node": "the rows are split as with rows, and each node keeps its ranks' rows once, in shared host memory "
            "(/dev/shm), which every rank of the node reads directly; rows move only between nodes",
    "zero": "DeepSpeed engine only: the tables are ordinary parameters that ZeRO partitions and gathers whole",
}
MEGATRON_TABLE_SHARDINGS = ("replicated", ROW_SHARDED, NODE_SHARED)  # the Megatron engine, the converters and fe-plan


def pipeline_stage_layers(num_layers: int, pipeline_size: int, stage: int) -> range:
    """The (0-based) layers pipeline stage ``stage`` holds: Megatron's even split, which needs
    ``pipeline_size`` to divide ``num_layers``."""
    per_stage = num_layers // pipeline_size
    return range(stage * per_stage, (stage + 1) * per_stage)


def stages_without_memory(memory_layers, num_layers: int, pipeline_size: int,
                          hybrid_layer_pattern: str = None, first: int = None, last: int = None) -> list:
    """The pipeline stages that hold none of ``memory_layers`` (the paper's layers 10 and 12 of 24
    leave stages 0 and 3 of four without memory): the GPT model's even split of its blocks, or a hybrid
    model's split of ``hybrid_layer_pattern`` (`fe_megatron.hybrid_pattern`; ``first``/``last``: the layers
    of its first and last stages, where the pattern has no ``|``)."""
    if hybrid_layer_pattern:
        from fe_megatron import hybrid_pattern

        return sorted(hybrid_pattern.stages_without_memory(hybrid_layer_pattern, memory_layers, pipeline_size,
                                                           first, last))
    return [stage for stage in range(pipeline_size)
            if not any(layer in pipeline_stage_layers(num_layers, pipeline_size, stage) for layer in memory_layers)]


@dataclass(frozen=True)
class ParamSharding:
    tensor_parallel_dim: Optional[int] = None
    row_parallel: bool = False
    is_table: bool = False

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor_parallel_dim is not None


_WHOLE = ParamSharding()
_TABLE = ParamSharding(tensor_parallel_dim=1, row_parallel=True, is_table=True)
_ROW_SCALE = ParamSharding(row_parallel=True, is_table=True)  # [rows]: fp8 serving storage only

SHARDING_PLAN = {
    "factorengram": {
        "tables.weight": _TABLE,  # [rows, s_b]
        "tables.row_scale": _ROW_SCALE,
        "dictionary": ParamSharding(tensor_parallel_dim=1),  # [branches, s_b, d_m]
        "query_proj.weight": _WHOLE,  # [d_m, d]
        "query_norm.weight": _WHOLE,  # [d_m]
        "value_proj.weight": _WHOLE,  # [out, d_m]
        "conv.norm.weight": _WHOLE,  # [out]
        "conv.weight": _WHOLE,  # [out, K]
    },
    "engram": {
        "tables.weight": _TABLE,  # [rows, s_b]
        "tables.row_scale": _ROW_SCALE,
        "value_proj.weight": ParamSharding(tensor_parallel_dim=2),  # [out, branches, s_b]
        "key_proj.weight": ParamSharding(tensor_parallel_dim=2),  # [d, branches, s_b]
        "key_norm.weight": _WHOLE,  # [d]
        "query_norm.weight": _WHOLE,  # [d]
        "conv.norm.weight": _WHOLE,  # [out]
        "conv.weight": _WHOLE,  # [out, K]
    },
}


def param_sharding(kind: str, name: str) -> ParamSharding:
    """The plan's entry for parameter ``name`` (relative to the branch) of a ``kind`` branch."""
    try:
        return SHARDING_PLAN[kind][name]
    except KeyError:
        raise KeyError(f"{kind} parameter {name!r} has no entry in fe_megatron.memory.sharding.SHARDING_PLAN; "
                       "add one (its split axis and attributes)") from None


def local_shape(kind: str, name: str, global_shape: tuple, tensor_parallel_size: int, row_partition=None) -> tuple:
    """This rank's shape of a parameter whose single-process shape is ``global_shape``; ``row_partition``
    (a `RowPartition`, or None when the tables are whole on every rank) gives its rows."""
    sharding = param_sharding(kind, name)
    shape = list(global_shape)
    dim = sharding.tensor_parallel_dim
    if dim is not None and tensor_parallel_size > 1:
        if global_shape[dim] % tensor_parallel_size:
            raise ValueError(f"tensor-parallel size {tensor_parallel_size} does not divide axis {dim} of {kind} "
                             f"{name} {tuple(global_shape)}")
        shape[dim] //= tensor_parallel_size
    if sharding.row_parallel and row_partition is not None:
        shape[0] = row_partition.local_rows()
    return tuple(shape)


def shard_state_dict(state_dict: dict, kind: str, tensor_parallel_rank: int, tensor_parallel_size: int,
                     row_partition=None) -> dict:
    """The state dict of one rank (``tensor_parallel_rank``, and ``row_partition.rank`` of the
    memory-parallel group when the tables are row-sharded) for a single-process ``state_dict``."""
    out = {}
    for name, tensor in state_dict.items():
        sharding = param_sharding(kind, name)
        dim = sharding.tensor_parallel_dim
        if dim is not None:
            width = tensor.shape[dim] // tensor_parallel_size
            tensor = tensor.narrow(dim, tensor_parallel_rank * width, width)
        if sharding.row_parallel and row_partition is not None:
            tensor = row_partition.take(tensor)
        out[name] = tensor.contiguous().clone()
    return out


def unshard_state_dicts(shards: list, kind: str, row_partition=None) -> dict:
    """Inverse of `shard_state_dict`: one state dict from the ranks' ones.  ``shards[i][j]`` is the
    state dict of tensor-parallel rank ``j`` and memory-parallel rank ``i``; without row sharding
    a flat list over tensor-parallel ranks is accepted."""
    grid = shards if isinstance(shards[0], list) else [shards]
    out = {}
    for name in grid[0][0]:
        sharding = param_sharding(kind, name)
        dim = sharding.tensor_parallel_dim
        rows = [t[0][name] if dim is None else torch.cat([s[name] for s in t], dim=dim) for t in grid]
        if sharding.row_parallel and row_partition is not None:
            out[name] = row_partition.assemble(rows)
        else:
            out[name] = rows[0].clone()
    return out
