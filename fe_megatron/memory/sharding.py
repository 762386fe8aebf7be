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
* ``is_table``: an n-gram table (learning-rate and weight-decay multipliers, `docs/training.md`).

The rationale for the split is in docs/parallelism.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ParamSharding:
    tensor_parallel_dim: Optional[int] = None
    is_table: bool = False

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor_parallel_dim is not None


_WHOLE = ParamSharding()
_TABLE = ParamSharding(tensor_parallel_dim=1, is_table=True)

SHARDING_PLAN = {
    "factorengram": {
        "tables.weight": _TABLE,  # [rows, s_b]
        "dictionary": ParamSharding(tensor_parallel_dim=1),  # [branches, s_b, d_m]
        "query_proj.weight": _WHOLE,  # [d_m, d]
        "query_norm.weight": _WHOLE,  # [d_m]
        "value_proj.weight": _WHOLE,  # [out, d_m]
        "conv.norm.weight": _WHOLE,  # [out]
        "conv.weight": _WHOLE,  # [out, K]
    },
    "engram": {
        "tables.weight": _TABLE,  # [rows, s_b]
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


def local_shape(kind: str, name: str, global_shape: tuple, tensor_parallel_size: int) -> tuple:
    """This rank's shape of a parameter whose single-process shape is ``global_shape``."""
    dim = param_sharding(kind, name).tensor_parallel_dim
    if dim is None or tensor_parallel_size == 1:
        return tuple(global_shape)
    if global_shape[dim] % tensor_parallel_size:
        raise ValueError(f"tensor-parallel size {tensor_parallel_size} does not divide axis {dim} of {kind} "
                         f"{name} {tuple(global_shape)}")
    shape = list(global_shape)
    shape[dim] //= tensor_parallel_size
    return tuple(shape)


def shard_state_dict(state_dict: dict, kind: str, tensor_parallel_rank: int, tensor_parallel_size: int) -> dict:
    """The state dict of tensor-parallel rank ``rank`` for a single-process (or gathered) ``state_dict``."""
    out = {}
    for name, tensor in state_dict.items():
        dim = param_sharding(kind, name).tensor_parallel_dim
        if dim is None:
            out[name] = tensor.clone()
        else:
            width = tensor.shape[dim] // tensor_parallel_size
            out[name] = tensor.narrow(dim, tensor_parallel_rank * width, width).contiguous()
    return out


def unshard_state_dicts(shards: list, kind: str) -> dict:
    """Inverse of `shard_state_dict`: the tensor-parallel ranks' state dicts, in rank order, to one."""
    out = {}
    for name, first in shards[0].items():
        dim = param_sharding(kind, name).tensor_parallel_dim
        out[name] = first.clone() if dim is None else torch.cat([shard[name] for shard in shards], dim=dim)
    return out
