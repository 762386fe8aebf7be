"""Convert memory-branch weights between the plain layout and tensor-parallel shards.

Plain (`fe_megatron.memory`): ``tables.weight`` [rows, s_b], ``dictionary`` [s, d_m],
Engram ``value_proj.weight`` [out, s] and ``key_proj.weight`` [d, s].
Sharded (`fe_megatron.megatron.memory_layer`): rank r holds columns ``[r w, (r+1) w)`` of
every branch (w = s_b / tp): ``tables.weight`` [rows, w], ``dictionary`` [branches, w, d_m],
Engram projections [out, branches, w].  Every other tensor is the same on all ranks.
"""

from __future__ import annotations

import torch

from fe_megatron.config import MemoryConfig


def _per_branch_axis(name: str, dense: bool):
    """(how to view the plain tensor per branch, the shard axis in that view); (None, None) for
    tensors that every rank holds whole (FactorEngram's value_proj maps d_m -> out: not split)."""
    if name.endswith("tables.weight"):
        return None, 1
    if name.endswith("dictionary"):
        return "rows", 1
    if dense and (name.endswith("value_proj.weight") or name.endswith("key_proj.weight")):
        return "cols", 2
    return None, None


def shard_plain_state_dict(plain: dict, memory_config: MemoryConfig, tp_rank: int, tp_size: int) -> dict:
    """The state dict of TP rank ``tp_rank`` for a plain memory module's ``plain`` state dict."""
    nb, s_b = memory_config.num_branches, memory_config.branch_width
    dense = memory_config.representation == "dense"
    w = s_b // tp_size
    out = {}
    for name, tensor in plain.items():
        view, axis = _per_branch_axis(name, dense)
        if axis is None:
            out[name] = tensor.clone()
            continue
        if view == "rows":
            tensor = tensor.reshape(nb, s_b, -1)
        elif view == "cols":
            tensor = tensor.reshape(tensor.shape[0], nb, s_b)
        out[name] = tensor.narrow(axis, tp_rank * w, w).contiguous()
    return out


def unshard_to_plain_state_dict(shards: list, memory_config: MemoryConfig) -> dict:
    """Inverse of `shard_plain_state_dict`: the TP ranks' state dicts, in rank order, to one plain one."""
    dense = memory_config.representation == "dense"
    out = {}
    for name, first in shards[0].items():
        view, axis = _per_branch_axis(name, dense)
        if axis is None:
            out[name] = first.clone()
            continue
        full = torch.cat([shard[name] for shard in shards], dim=axis)
        if view == "rows":
            full = full.reshape(-1, full.shape[-1])
        elif view == "cols":
            full = full.reshape(full.shape[0], -1)
        out[name] = full
    return out
