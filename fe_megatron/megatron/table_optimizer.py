"""The Megatron engine's tables in stores: row-sharded tables, bf16 tables, the host tier, bf16
optimizer state, a sparse table update, and every table of a bf16 run or of an expert-parallel
backbone.

When the run's tables are in stores (`fe_megatron.tables.plan.TablePlan`) `manage_tables` moves every memory
branch of this pipeline stage into one before the model goes to the GPU, so host-resident tables
never touch it.  The tables are then neither parameters nor buffers of the model (their
rows are the stores', `fe_megatron.memory.tables.NgramTables`):
Megatron's DDP neither buckets nor all-reduces them and its optimizer keeps no fp32 copy of them.
`TableOptimizer` trains them as a member of Megatron's `ChainedOptimizer` (in the place Megatron's
own table optimizer holds otherwise, `fe_megatron.megatron.memory_layer`), so that

* the scheduler sets its learning rate and weight decay (its parameter group carries
  ``max_lr``/``min_lr``/``lr_mult``/``wd_mult`` as the engine's table group does);
* checkpoints hold its moments under the names Megatron gives an optimizer's state
  (``optimizer.state.exp_avg.<table>``), by global row as the tables are, so they reshard the same way
  (the tables' one checkpoint description, `fe_megatron.megatron.table_shards`, which ``fe_tables/``
  holds too);
* one global gradient norm covers the backbone and the tables: `TableChainedOptimizer` hands the
  norm it computes to the table optimizer, which clips the tables by it (the chain clips its
  members through their parameters' ``.grad``, which tables in stores do not have).

Gradient averaging matches Megatron's DDP: whole tables are all-reduced over the data-parallel
(times context-parallel) ranks, row-sharded ones already arrive at their owners; both are scaled
by 1 / (DP x CP).
"""

from __future__ import annotations

import copy

import torch
from megatron.core import parallel_state

from fe_megatron.megatron import compat
from fe_megatron.megatron.parallel import table_row_group
from fe_megatron.megatron.table_shards import row_slices_factory, table_state
from fe_megatron.memory.branch import memory_branches
from fe_megatron.tables.plan import TablePlan
from fe_megatron.tables.stage_tables import StageTables
from fe_megatron.tables.update_rules import UpdateRule


def refuse_table_optimizer_change(folder: str, saved_info: dict, info: dict) -> None:
    """A checkpoint resumes with its tables' optimizer state in another layout only without the
    distributed optimizer.  Tables trained from stores save their moments by table, under the same
    names as Megatron's own optimizer does for tables held as its parameters, so a change of
    ``memory.table_dtype``, ``table_placement`` or ``optimizer.table_state_dtype`` loads (the
    values are cast); Megatron's distributed optimizer saves them in its flat buffers instead, which
    the table optimizer cannot read, nor it the table optimizer's.  ``info["tables"]`` (``stores``
    or ``parameters``) records which one a run used."""
    from fe_megatron.checkpoint.files import CheckpointError

    saved_info = saved_info or {}
    saved, current = TablePlan.saved_mode(saved_info), info.get("tables")  # this run's plan.mode, None without memory
    distributed = [bool(((i.get("config") or {}).get("parallel") or {}).get("distributed_optimizer"))
                   for i in (saved_info, info)]
    if saved is None or current is None or saved == current or not any(distributed):
        return
    where = {"stores": "in table stores (row-sharded tables, bf16 tables, the host tier, bf16 state, a sparse "
                       "update, a bf16 run, an expert-parallel backbone, or a pipeline stage without memory)",
             "parameters": "as Megatron's parameters (whole fp32 tables on the device, fp32 state, AdamW, an fp32 "
                           "run; also row-sharded tables in checkpoints written before they moved to the table "
                           "optimizer)"}
    raise CheckpointError(f"{folder} trained its tables {where[saved]}, and this run trains them "
                          f"{where[current]}; with parallel.distributed_optimizer the two keep "
                          "the tables' Adam moments in layouts that do not load into each other. Resume with the "
                          "settings that kept them where the checkpoint did (parallel.table_sharding, parallel.expert, "
                          "memory.table_dtype, memory.table_placement, optimizer.table_state_dtype, "
                          "optimizer.table_update, training.precision, parallel.pipeline), or start a new run from "
                          "its weights (fe-convert mcore-to-hf, then hf-to-mcore, and --load the output)")


def refuse_tables_left_to_ddp(memory_config, table_sharding: str, model_config: str) -> None:
    """The guard of a model built without its tables moved into stores (``model_config``'s
    ``tables_into_stores`` unset): the table plan of what the model's configuration says (its tables' dtype
    and placement, its ``table_sharding``; the optimizer's settings take their defaults) must leave the tables
    to the engine's optimizer.  Otherwise DDP would all-reduce row shards as if they were whole tables, or no
    optimizer would train bf16 or host-memory tables."""
    plan = TablePlan.resolve("megatron", memory_config.table_dtype, placement=memory_config.table_placement,
                             sharding=table_sharding)
    if plan.in_stores:
        raise ValueError(f"the table plan keeps these tables in stores ({', '.join(plan.reasons)}), which must hold "
                         f"them before DDP wraps the model: set {model_config}.tables_into_stores and add the table "
                         "optimizer to the chain, as fe_megatron.megatron_lm.run does (TrainerState.take_tables, "
                         "add_table_member)")


def manage_tables(model, optimizer_args, plan: TablePlan, device, seed: int) -> StageTables:
    """Every memory branch of this pipeline stage's ``model`` in a store, kept and trained as the run's
    ``plan`` says (its placement, sharding, state dtype, update rule, and whether the model's state dict
    keeps the tables), with the groups and averaging of Megatron's layout."""
    data_parallel = parallel_state.get_data_parallel_group(with_context_parallel=True)
    norm_groups = [parallel_state.get_tensor_model_parallel_group(), parallel_state.get_pipeline_model_parallel_group()]
    rows = plan.row_sharded
    if rows:  # every rank of the tables' row group holds other rows
        norm_groups.append(table_row_group())
    return StageTables(memory_branches(model), optimizer_args, plan, device,
                       replica_group=None if rows else data_parallel, norm_groups=norm_groups,
                       gradient_scale=1.0 / torch.distributed.get_world_size(data_parallel), seed=seed,
                       row_group=parallel_state.get_tensor_model_parallel_group())


class TableOptimizer(compat.fp32_optimizer_class()):
    """`StageTables` as a member of Megatron's optimizer chain (see the module docstring).  A
    pipeline stage without memory layers holds one over no tables, so that every stage takes
    part in the norm's reductions."""

    def __init__(self, tables: StageTables, config, table_lr_mult: float = 1.0, table_weight_decay_mult: float = 1.0):
        super().__init__(tables.optimizer, config, init_state_fn=lambda optimizer, _: optimizer.initialize_state())
        self.tables = tables
        self.global_grad_norm = None  # set by TableChainedOptimizer.get_grad_norm
        self.momentum_layout = "rows"  # how rowwise_adagrad's state is checkpointed (sharded_state_dict)
        for group in tables.optimizer.param_groups:  # what the scheduler and the checkpoint loader read
            group.update(max_lr=config.lr * table_lr_mult, min_lr=(config.min_lr or 0.0) * table_lr_mult,
                         lr_mult=table_lr_mult, wd_mult=table_weight_decay_mult, is_expert_parallel=True,
                         is_decoupled_lr=False)

    def get_parameters(self) -> list:
        return []  # nothing for the chain to clip or count through .grad: step_with_ready_grads clips

    def get_grad_stats_parallel_group(self):
        return None  # get_grad_norm reduces over its own groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.tables.zero_grad()
        self.global_grad_norm = None

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        self.tables.reduce_gradients()
        return False

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        return self.tables.grad_norm()

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        norm = self.global_grad_norm if self.global_grad_norm is not None else self.tables.grad_norm()
        self.tables.clip_and_step(self.config.clip_grad, norm)
        return True

    @torch.no_grad()
    def step(self):
        """Alone (outside a chain): clip by the tables' own norm and update."""
        self.prepare_grads()
        self.global_grad_norm = self.get_grad_norm()
        return self.step_with_ready_grads(), self.global_grad_norm, None

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        """As `FP32Optimizer`'s, over the tables (which `get_parameters` does not list): each table's state
        described by the tables' one checkpoint description (`fe_megatron.megatron.table_shards`), under
        the model's name of the table (``optimizer.state.exp_avg.<table>``), by global row, and the step
        count always written, from the counter every stage keeps: only global rank 0 writes a checkpoint's
        common part, and its stage may hold no table.

        The rule's per-row state (`fe_megatron.tables.update_rules.UpdateRule.row_state_keys`, e.g.
        ``rowwise_adagrad``'s accumulator) is written as ``optimizer.state.row_<key>.<table>``, a [global
        rows, 1] tensor: 4 bytes per row instead of per table parameter. ``rowwise_adagrad``'s checkpoints
        written before that (``momentum_layout = "columns"``, which `load_checkpoint` sets from the
        checkpoint's own keys) hold its accumulator repeated across the row's columns, under
        ``optimizer.state.momentum.<table>``; it is read back from the first column."""
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

        self.optimizer.initialize_state()  # every table has all its keys, also before its first update
        state_dict = self.state_dict()
        model_tables = compat.sharded_parameters(model_sharded_state_dict, self.tables.weights)
        for index, state in list(state_dict["state"].items()):
            values, entries = self._state_as_checkpointed(index, state, is_loading)
            # each table's step count is not saved: FP32Optimizer's loader sets it from common_step
            state_dict["state"][index] = table_state(self.tables, index, model_tables[index].key, values, entries,
                                                     row_slices_factory)
        state_dict["state"]["common_step"] = torch.tensor(float(self.tables.steps))
        # the groups' parameters are this run's, not the checkpoint's (as megatron-core's optimizers keep them)
        state_dict["param_groups"] = copy.deepcopy(state_dict["param_groups"])
        for group in state_dict["param_groups"]:
            group["params"] = LocalNonpersistentObject(group["params"])
        return state_dict

    def _state_as_checkpointed(self, index: int, state: dict, is_loading: bool) -> tuple:
        """``(values, entries)``: table ``index``'s state ``state`` as its checkpoint holds it (see
        `sharded_state_dict`), ``entries`` as `UpdateRule.state_layout`. Per-row state is [rows, 1], and
        zeros to load into (the loaded values reach the optimizer through `load_state_dict`)."""
        values, entries = {}, []
        for entry in self.tables.rule.state:
            value = state[entry.key]
            if entry.per_row and entry.key == "momentum" and self.momentum_layout == "columns":
                width = self.tables.weights[index].shape[1]
                values[entry.key] = value.new_zeros(value.shape[0], width) if is_loading else \
                    value.unsqueeze(1).expand(-1, width).contiguous()
                entries.append((entry.key, False))
            elif entry.per_row:
                values[entry.key] = value.new_zeros(value.shape[0], 1) if is_loading else value.unsqueeze(1)
                entries.append((entry.key, True))
            else:
                values[entry.key] = value
                entries.append((entry.key, False))
        return values, tuple(entries)

    def load_state_dict(self, state_dict) -> None:
        self.tables.steps = int(state_dict["state"]["common_step"])
        for state in state_dict["state"].values():
            for key in self.tables.rule.row_state_keys:
                name = UpdateRule.checkpoint_key(key, per_row=True)
                if isinstance(state, dict) and name in state:
                    state[key] = state.pop(name)  # [rows, 1]: the optimizer reads its first column
        super().load_state_dict(state_dict)


class TableChainedOptimizer(compat.chained_optimizer_class()):
    """Megatron's chain with a `TableOptimizer` among its members: the global norm it computes is
    what the table optimizer clips by."""

    @torch.no_grad()
    def get_grad_norm(self):
        norm = super().get_grad_norm()
        for member in compat.optimizer_members(self):
            if isinstance(member, TableOptimizer):
                member.global_grad_norm = norm
        return norm
