"""Build a memory branch inside a Megatron layer, and checkpoint it.

The branch is the single-process `fe_megatron.memory.FactorEngram` / `Engram`, run with
`MegatronParallelHooks`.  Its parameters' Megatron attributes and its ``sharded_state_dict`` come
from the sharding plan (`fe_megatron.memory.sharding.SHARDING_PLAN`), so the global names and
shapes in a checkpoint are those of a single-process module at every layout.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron.memory_parallel import MegatronParallelHooks
from fe_megatron.memory import MemoryBranch, build_memory
from fe_megatron.memory.sharding import param_sharding


def build_memory_branch(config: TransformerConfig, memory_config: MemoryConfig, layer_index: int,
                        tp_group: Optional[dist.ProcessGroup] = None) -> MemoryBranch:
    """The branch of insertion layer ``layer_index`` for this rank, with its Megatron attributes."""
    tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group() if config.context_parallel_size > 1 else None
    hooks = MegatronParallelHooks(tp_group, config.sequence_parallel, cp_group)
    branch = build_memory(memory_config, layer_index, hooks, initialize=config.perform_initialization)
    for name, param in branch.named_parameters():
        sharding = param_sharding(branch.kind, name)
        if sharding.tensor_parallel:
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=sharding.tensor_parallel_dim, stride=1)
        else:  # whole on every TP rank, and sees only local tokens under SP: TP sums its gradient
            param.sequence_parallel = hooks.sequence_parallel
        if sharding.is_table:
            param.is_memory_table = True  # the optimizer's table group (builder.build_optimizer)
            param.allreduce = True
    return branch


def memory_sharded_state_dict(branch: MemoryBranch, prefix: str, sharded_offsets: tuple = (),
                              metadata: Optional[dict] = None) -> dict:
    """ShardedTensors of the branch's parameters, split along the plan's tensor-parallel axes."""
    state = branch.state_dict(prefix="", keep_vars=True)
    axes = {name: param_sharding(branch.kind, name).tensor_parallel_dim for name in state}
    return make_sharded_tensors_for_checkpoint(state, prefix, {n: a for n, a in axes.items() if a is not None},
                                               sharded_offsets, tp_group=branch.parallel.tp_group,
                                               dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"])
