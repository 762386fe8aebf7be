"""StageTables: the one owner of a pipeline stage's tables when fe_megatron's optimizer trains them.

The engines' optimizers hold every parameter in device memory and, for bf16 weights, keep an fp32
copy beside them: 18 bytes per table parameter where the tables are most of the model.  When the
table plan (`fe_megatron.tables.plan.TablePlan`) keeps the tables in stores (bf16 tables, tables in
host memory, bf16 optimizer state, a sparse ``optimizer.table_update``, row sharding; docs/tables.md),
`StageTables` is built from the plan over the memory branches of one pipeline stage, and it alone
holds, for every table:

* its rows: a `TableStore` (`fe_megatron.tables.store`) in the plan's placement, which the module
  reads through (`fe_megatron.memory.tables.NgramTables.weight`);
* their gradient: the store's dense ``main_grad`` (fp32, or bf16 with ``state_dtype="bf16"``), or,
  for a sparse rule, its `RowGradients`;
* with node-shared tables (``table_sharding: node``), the node's shared segments the row shards move
  into (`fe_megatron.tables.node_shared`);
* the optimizer state: one optimizer of the plan's rule (`fe_megatron.tables.update_rules`) over
  the stores;
* the checkpoint sharding: each table's `TableLayout` (which global rows and columns the local ones
  are) and `RowPartition` (how the rows are split over the row group), which both engines'
  checkpoints shard by.

Nothing of it hangs on the rows' tensors: the optimizer asks the store for the gradient and layout.
Per step, for an engine:

1. the lookups' backward adds row gradients into each store (in host memory for the host tier);
2. `reduce_gradients` (once per step) waits for the host tier's additions, all-reduces the
   gradients of whole tables over ``replica_group`` (the ranks holding the same rows: the row
   exchange already delivered row-sharded gradients to their owners) and multiplies them by
   ``gradient_scale``, the engine's averaging over data-parallel ranks;
3. `grad_norm` sums the squares over ``norm_groups`` (the groups whose ranks hold different rows,
   columns or layers), so the engine can clip everything by one global norm (`clip`);
4. `step` runs the table update where the tables live (`TableAdamW` over every row, or a sparse
   rule over the touched rows, `fe_megatron.tables.sparse_update`), and `zero_grad` clears the
   gradients.

With a sparse rule step 2 reduces whole tables' touched rows over the replicas (each replica's row
ids are gathered, and the sums of their union all-reduced), and steps 3-4 read and scale those rows
only.

Per table parameter a rank holds weight + gradient + two moments: 4+4+8 = 16 bytes for fp32 tables
with fp32 state (the engine's own layout), 2+4+8 = 14 for bf16 tables, 2+2+4 = 8 for bf16 tables
with bf16 state; with ``table_placement: host`` all of it is in host memory.

Only torch is used here, so the Megatron engine (`fe_megatron.megatron.table_optimizer`) and the
DeepSpeed engine (`fe_megatron.deepspeed.tables`) share it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fe_megatron.tables.layout import TableLayout
from fe_megatron.tables.optimizer import STATE_DTYPES
from fe_megatron.tables.plan import ROW_SHARDED_STORE, TablePlan

REDUCE_CHUNK = 1 << 24  # elements of a gradient all-reduced at a time (host-resident: through the device)
NORM_CHUNK = 1 << 22  # elements of a gradient normed at a time, in float64 (a 32 MB scratch)


class StageTables:
    """The tables of ``branches`` (``{name: MemoryBranch}``, one pipeline stage's), moved into stores and
    trained as ``plan`` says (its placement, state dtype, update rule, and whether the model's state
    dict keeps the rows or the engine saves them in files of its own).

    ``optimizer_args``: the run's optimizer section (lr, betas, eps, weight decay, table multipliers).
    ``device``: where stores in device memory live.  ``replica_group``: the group whose ranks hold the
    same (whole) tables, or None.  ``norm_groups``: the groups to sum squared norms over.
    ``gradient_scale``: multiplies the reduced gradients (the engine's averaging).  ``seed``: part of the
    rounding's key.  ``row_group``: the tensor-parallel ranks holding the other columns of the same rows
    (what the row-wise rules sum a row's squares over).

    Readers ask it: ``stores`` (by the table's parameter name), ``partitions`` (their `RowPartition`, or
    None for whole tables), ``weights`` and ``layouts`` (in the optimizer's order), ``rule``."""

    def __init__(self, branches: dict, optimizer_args, plan: TablePlan, device=None,
                 replica_group: Optional[dist.ProcessGroup] = None, norm_groups: tuple = (),
                 gradient_scale: float = 1.0, seed: int = 0, row_group: Optional[dist.ProcessGroup] = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.plan, self.rule = plan, plan.rule
        self.replica_group, self.norm_groups, self.gradient_scale = replica_group, tuple(norm_groups), gradient_scale
        self.sparse = self.rule.sparse
        self.stores, self.partitions = {}, {}
        for name, branch in branches.items():
            layout = TableLayout(branch.layer_index, tuple(branch.global_row_slices("tables.weight")),
                                 branch.parallel.tensor_parallel_rank * branch.tables.weight.shape[1],
                                 branch.config.branch_width)
            store = branch.tables.manage(plan.placement, self.device, plan.tables_in_model_state_dict, layout,
                                         *self._row_split(name, branch))
            if self.sparse:
                store.allocate_row_gradients()
            else:
                store.allocate_gradient(STATE_DTYPES[plan.state_dtype])
            self.stores[f"{name}.tables.weight"] = store
            self.partitions[f"{name}.tables.weight"] = branch.row_partition
        if plan.node_shared and self.stores:
            self._share_node_rows(branches)
        self.weights = [store.weight for store in self.stores.values()]
        self.layouts = [store.layout for store in self.stores.values()]
        self.optimizer = self.rule.build(list(self.stores.values()), optimizer_args, plan.state_dtype, seed, row_group)
        self._reduced = False
        self.steps = 0  # updates applied, also by a pipeline stage without tables: the step count checkpoints keep

    def _row_split(self, name: str, branch) -> tuple:
        """``(partition, row group)`` the store's holder looks rows up over: the branch's, when the plan keeps the
        tables row-sharded (`TablePlan.holder`), else none; a branch built otherwise than the plan says is
        refused by name."""
        row_sharded = self.plan.holder == ROW_SHARDED_STORE
        if row_sharded != (branch.row_partition is not None):
            built = "with its rows split over a row group" if branch.row_partition is not None else "with whole tables"
            raise ValueError(f"{name}: the table plan keeps the tables as {self.plan.holder} (table_sharding "
                             f"{self.plan.sharding!r}), but the branch was built {built}; build the model with the "
                             "same table_sharding as the plan")
        return (branch.row_partition, branch.parallel.memory_parallel_group) if row_sharded else (None, None)

    def _share_node_rows(self, branches: dict) -> None:
        """Node-shared tables (``table_sharding: node``): each rank's row shard moves into its node's shared
        segment (`fe_megatron.tables.node_shared`), before the optimizer takes the rows."""
        from fe_megatron.tables.node_shared import share_node_rows

        groups = {id(branch.parallel.memory_parallel_group) for branch in branches.values()}
        if len(groups) != 1:  # a branch without split rows was refused already (`_row_split`)
            raise ValueError("node-shared tables are row-sharded over one row group: build the memory branches with "
                             "their rows split (the engine does it for parallel.table_sharding: node)")
        group = next(iter(branches.values())).parallel.memory_parallel_group
        share_node_rows(list(self.stores.values()), list(self.partitions.values()), group, self.plan.shared_folder)

    def global_rows(self, name: str) -> int:
        """The rows of table ``name`` in the whole model (every rank's, when its rows are sharded)."""
        partition = self.partitions[name]
        return sum(partition.branch_rows) if partition is not None else self.stores[name].weight.shape[0]

    def numel(self) -> int:
        """Table parameters of the whole model (every rank's rows; this rank's columns)."""
        return sum(self.global_rows(name) * store.weight.shape[1] for name, store in self.stores.items())

    def zero_grad(self) -> None:
        for store in self.stores.values():
            store.wait_for_gradients()
            if store.sparse:
                store.row_gradients.clear()
            else:
                store.main_grad.zero_()
        self._reduced = False

    def _gradients(self, store) -> list:
        """The tensors holding ``store``'s gradient: the dense accumulator, or the touched rows' sums."""
        return [store.row_gradients.coalesce()[1]] if store.sparse else [store.main_grad]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Make every gradient (``main_grad``, or the row gradients) final for the step (see the module
        docstring); idempotent until `zero_grad`."""
        if self._reduced:
            return
        replicas = self.replica_group is not None and dist.get_world_size(self.replica_group) > 1
        for store in self.stores.values():
            store.wait_for_gradients()
            if replicas:
                if store.sparse:
                    self._all_reduce_rows(store.row_gradients)
                else:
                    self._all_reduce(store.main_grad)
            if self.gradient_scale != 1.0:
                for grad in self._gradients(store):
                    grad.mul_(self.gradient_scale)
        self._reduced = True

    def _all_reduce_rows(self, gradients) -> None:
        """Sum the replicas' row gradients: every replica's touched row ids are gathered, and the sums
        over their union all-reduced, so each replica updates the same rows by the same gradient."""
        ids, rows = gradients.coalesce()
        group, device = self.replica_group, self.device
        counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(counts, torch.tensor([ids.numel()], dtype=torch.int64, device=device), group=group)
        longest = int(max(count.item() for count in counts))
        padded = torch.full((longest,), -1, dtype=torch.int64, device=device)
        padded[:ids.numel()] = ids.to(device)
        everyone = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(everyone, padded, group=group)
        union = torch.unique(torch.cat(everyone))
        union = union[union >= 0]
        summed = torch.zeros(union.numel(), rows.shape[1], dtype=torch.float32, device=device)
        summed.index_copy_(0, torch.searchsorted(union, ids.to(device)), rows.to(device))
        dist.all_reduce(summed, group=group)
        gradients.replace(union.to(ids.device), summed.to(rows.device))

    def _all_reduce(self, grad: torch.Tensor) -> None:
        """Sum ``grad`` over the replicas, in fp32; through the device in chunks when it is in host memory
        and the group's backend (NCCL) cannot read host memory."""
        direct = grad.device == self.device or dist.get_backend(self.replica_group) == "gloo"
        if direct and grad.dtype == torch.float32:
            dist.all_reduce(grad, group=self.replica_group)
            return
        flat = grad.view(-1)
        for first in range(0, flat.numel(), REDUCE_CHUNK):
            chunk = flat[first:first + REDUCE_CHUNK]
            staged = chunk.to(grad.device if direct else self.device, torch.float32, copy=True)
            dist.all_reduce(staged, group=self.replica_group)
            chunk.copy_(staged)

    def grad_norm(self) -> float:
        """The global L2 norm of the tables' gradients (after `reduce_gradients`), on every rank."""
        self.reduce_gradients()
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for store in self.stores.values():  # in float64, a chunk at a time: no table-sized temporary
            for grad in self._gradients(store):
                store_squares = sum((torch.linalg.vector_norm(chunk, dtype=torch.float64).square()
                                     for chunk in grad.reshape(-1).split(NORM_CHUNK)),
                                    torch.zeros((), dtype=torch.float64, device=grad.device))
                squares += store_squares.to(self.device)  # once per store, where it lives
        for group in self.norm_groups:
            dist.all_reduce(squares, group=group)
        return float(squares.sqrt())

    @torch.no_grad()
    def clip(self, coefficient: float) -> None:
        """Scale the gradients by ``coefficient`` (the engine's clip, from the global norm) when it is below 1."""
        if coefficient < 1.0:
            for store in self.stores.values():
                for grad in self._gradients(store):
                    grad.mul_(coefficient)

    def clip_and_step(self, clip_grad: float, norm: float) -> None:
        """What every engine does with the tables at a step: clip them by the engine's global ``norm``
        (Megatron's coefficient ``clip_grad / (norm + 1e-6)``, when ``clip_grad`` > 0 and it is below 1),
        then update them."""
        if clip_grad > 0.0:
            self.clip(clip_grad / (norm + 1.0e-6))
        self.step()

    def step(self) -> None:
        """One update of every table (``update``'s rule), where it lives."""
        self.reduce_gradients()
        self.optimizer.step()
        self.steps += 1
