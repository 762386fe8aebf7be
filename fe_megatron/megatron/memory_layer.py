"""Build a memory branch inside a Megatron layer, and checkpoint it.

The branch is the single-process `fe_megatron.memory.FactorEngram` / `Engram`, run with
`MegatronParallelHooks`.  Its parameters' Megatron attributes and its ``sharded_state_dict`` come
from the sharding plan (`fe_megatron.memory.sharding.SHARDING_PLAN`), so the global names and
shapes in a checkpoint are those of a single-process module at every layout.

Tables that are Megatron's parameters (whole fp32 tables on the device, `fe_megatron.tables.plan`)
carry ``allreduce=False``, so DDP keeps them in separate buffers reduced over the expert-data-
parallel group, with the same 1/DP gradient scaling as every other parameter, and Megatron's
optimizer updates them in its own chain member (its distributed optimizer shards their moments).
With no expert parallelism that group is the data-parallel one: whole tables, gradients all-
reduced, as any weight.

Row-sharded tables are sharded over the tables' own row group (`fe_megatron.megatron.parallel.
table_row_group`: every data-parallel rank, whatever an MoE backbone's expert parallelism), and
live in stores, as do bf16 tables, the host tier, bf16 optimizer state and the tables of an
expert-parallel backbone: they are not parameters at all, and `fe_megatron.megatron.table_optimizer`
trains them as the chain's table member, saved under the same names, which is why a checkpoint of
one loads into the other.  Megatron-LM's own trainer (`fe_megatron.megatron_lm`) follows the same plan.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from fe_megatron.config import MemoryConfig
from fe_megatron.megatron import compat
from fe_megatron.megatron.memory_parallel import MegatronParallelHooks
from fe_megatron.megatron.parallel import table_row_group
from fe_megatron.megatron.table_shards import row_slices_factory
from fe_megatron.memory import MemoryBranch, build_memory
from fe_megatron.memory.sharding import MEGATRON_TABLE_SHARDINGS, param_sharding
from fe_megatron.tables.layout import TableLayout
from fe_megatron.tables.plan import shards_rows


def build_memory_branch(config: TransformerConfig, memory_config: MemoryConfig, layer_index: int,
                        tp_group: Optional[dist.ProcessGroup] = None,
                        table_sharding: str = "replicated") -> MemoryBranch:
    """The branch of insertion layer ``layer_index`` for this rank, with its Megatron attributes."""
    if table_sharding not in MEGATRON_TABLE_SHARDINGS:
        raise ValueError(f"table_sharding={table_sharding!r} is not one of {MEGATRON_TABLE_SHARDINGS}")
    if memory_config.table_dtype == "fp8":
        raise ValueError("memory table_dtype='fp8' is a serving format (fe-convert --table-dtype, the Hugging Face "
                         "model); the Megatron layers train fp32 or bf16 tables")
    tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group() if config.context_parallel_size > 1 else None
    memory_parallel_group = table_row_group() if shards_rows(table_sharding) else None  # the plan's rule
    hooks = MegatronParallelHooks(tp_group, config.sequence_parallel, cp_group, memory_parallel_group)
    branch = build_memory(memory_config, layer_index, hooks, initialize=config.perform_initialization)
    for name, param in branch.named_parameters():
        sharding = param_sharding(branch.kind, name)
        if sharding.tensor_parallel:
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=sharding.tensor_parallel_dim, stride=1)
        else:  # whole on every TP rank, and sees only local tokens under SP: TP sums its gradient
            param.sequence_parallel = hooks.sequence_parallel
        if sharding.is_table:
            param.is_memory_table = True  # the optimizer's table group (builder.build_optimizer)
        # tables: reduced over the expert-data-parallel group only (see the module docstring)
        param.allreduce = not sharding.row_parallel
        param.row_sharded = sharding.row_parallel and branch.row_partition is not None
    return branch


def memory_sharded_state_dict(branch: MemoryBranch, prefix: str, sharded_offsets: tuple = (),
                              metadata: Optional[dict] = None, state: Optional[dict] = None) -> dict:
    """ShardedTensors of the branch's parameters (``state``: of these tensors only, ``{name relative to
    the branch: tensor}``): split along the plan's tensor-parallel axes, and row-sharded tables as one
    uneven chunk per branch at its global row offset."""
    state = branch.state_dict(prefix="", keep_vars=True) if state is None else state
    row_sharded = {name for name in state
                   if param_sharding(branch.kind, name).row_parallel and branch.row_partition is not None}
    axes = {name: param_sharding(branch.kind, name).tensor_parallel_dim for name in state if name not in row_sharded}
    sharded = make_sharded_tensors_for_checkpoint({n: t for n, t in state.items() if n not in row_sharded}, prefix,
                                                  {n: a for n, a in axes.items() if a is not None}, sharded_offsets,
                                                  tp_group=branch.parallel.tp_group,
                                                  dp_cp_group=compat.ensure_metadata_dp_cp_group(metadata))
    for name in row_sharded:
        if sharded_offsets:
            raise ValueError("row-sharded memory tables are saved layer by layer (non_homogeneous_layers); "
                             f"got sharded_offsets={sharded_offsets}")
        sharded[f"{prefix}{name}"] = _row_sharded_factory(branch, name, state[name], f"{prefix}{name}")
    return sharded


def _row_sharded_factory(branch: MemoryBranch, name: str, param: torch.Tensor, key: str):
    """This rank's rows of a table, per branch, each at its global offset: the tables' one checkpoint
    description (`fe_megatron.megatron.table_shards.row_slices_factory`). A factory, so that the optimizer's
    states of the table are saved the same way."""
    global_rows, global_width = branch.global_shape(name)
    layout = TableLayout(branch.layer_index, tuple(branch.global_row_slices(name)),
                         branch.parallel.tensor_parallel_rank * param.shape[1], global_width)
    # every rank of the row group holds other rows, of other layers or columns elsewhere
    return row_slices_factory(key, param, layout, global_rows, (0, 0, 0))
