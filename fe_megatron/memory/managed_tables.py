"""ManagedTables: a model's tables trained by fe_megatron's own optimizer instead of the engine's.

The engines' optimizers hold every parameter in device memory and, for bf16 weights, keep an fp32
copy beside them: 18 bytes per table parameter where the tables are most of the model.  When the
storage asks for what they cannot hold (`uses_table_stores`: bf16 tables, tables in host memory,
or bf16 optimizer state; docs/tables.md) every memory branch's table moves into a `TableStore`
(`fe_megatron.memory.table_store`) and is trained here:

1. the lookups' backward adds row gradients into each store's ``main_grad`` (fp32, or bf16 with
   ``state_dtype="bf16"``; in host memory for the host tier);
2. `reduce_gradients` (once per step) waits for the host tier's additions, all-reduces the
   gradients of whole tables over ``replica_group`` (the ranks holding the same rows: the row
   exchange already delivered row-sharded gradients to their owners) and multiplies them by
   ``gradient_scale``, the engine's averaging over data-parallel ranks;
3. `grad_norm` sums the squares over ``norm_groups`` (the groups whose ranks hold different rows,
   columns or layers), so the engine can clip everything by one global norm (`clip`);
4. `step` runs `TableAdamW` where the tables live, and `zero_grad` clears the accumulators.

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

from fe_megatron.memory.branch import MemoryBranch
from fe_megatron.memory.table_optimizer import STATE_DTYPES, TableAdamW, TableLayout

REDUCE_CHUNK = 1 << 24  # elements of a gradient all-reduced at a time (host-resident: through the device)
NORM_CHUNK = 1 << 22  # elements of a gradient normed at a time, in float64 (a 32 MB scratch)


def storage_needs_stores(table_dtype: str, table_placement: str, state_dtype: str) -> bool:
    """Whether tables kept so are trained from `TableStore`s (by `ManagedTables`) rather than as the
    engine's parameters: bf16 tables, the host tier, or bf16 optimizer state."""
    return table_dtype != "fp32" or table_placement == "host" or state_dtype != "fp32"


def uses_table_stores(memory, state_dtype: str = "fp32") -> bool:
    """`storage_needs_stores` of a run's memory config (None: no tables)."""
    return memory is not None and storage_needs_stores(memory.table_dtype, memory.table_placement, state_dtype)


def memory_branches(model: torch.nn.Module) -> dict:
    """``{module name: branch}`` of every memory branch in ``model``."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MemoryBranch)}


class ManagedTables:
    """The tables of ``branches`` (``{name: MemoryBranch}``), moved into stores on ``device`` or the
    host per each branch's ``table_placement``, with one `TableAdamW` over them.

    ``optimizer_args``: the run's optimizer section (lr, betas, eps, weight decay, table multipliers).
    ``replica_group``: the group whose ranks hold the same (whole) tables, or None.
    ``norm_groups``: the groups to sum squared norms over.  ``gradient_scale``: multiplies the
    reduced gradients (the engine's averaging).  ``seed``: part of the rounding's key.
    """

    def __init__(self, branches: dict, optimizer_args, state_dtype: str = "fp32", device=None,
                 replica_group: Optional[dist.ProcessGroup] = None, norm_groups: tuple = (),
                 gradient_scale: float = 1.0, seed: int = 0):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.replica_group, self.norm_groups, self.gradient_scale = replica_group, tuple(norm_groups), gradient_scale
        self.stores, self.partitions = {}, {}
        for name, branch in branches.items():
            store = branch.tables.manage(branch.config.table_placement, self.device)
            store.weight.main_grad = store.allocate_gradient(STATE_DTYPES[state_dtype])
            store.weight.table_layout = TableLayout(
                branch.layer_index, tuple(branch.global_row_slices("tables.weight")),
                branch.parallel.tensor_parallel_rank * store.weight.shape[1], branch.config.branch_width)
            self.stores[f"{name}.tables.weight"] = store
            self.partitions[f"{name}.tables.weight"] = branch.row_partition
        o = optimizer_args
        self.weights = [store.weight for store in self.stores.values()]
        self.optimizer = TableAdamW(
            [{"params": self.weights, "lr_mult": o.table_lr_mult, "wd_mult": o.table_weight_decay_mult}],
            lr=o.lr * o.table_lr_mult, betas=(o.beta1, o.beta2), eps=o.eps,
            weight_decay=o.weight_decay * o.table_weight_decay_mult, state_dtype=state_dtype, seed=seed)
        self._reduced = False
        self.steps = 0  # updates applied, also by a pipeline stage without tables: the step count checkpoints keep

    def numel(self) -> int:
        """Table parameters of the whole model (every rank's rows; this rank's columns)."""
        return sum((sum(p.branch_rows) if p is not None else store.weight.shape[0]) * store.weight.shape[1]
                   for p, store in zip(self.partitions.values(), self.stores.values()))

    def zero_grad(self) -> None:
        for store in self.stores.values():
            store.wait_for_gradients()
            store.main_grad.zero_()
        self._reduced = False

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Make every ``main_grad`` final for the step (see the module docstring); idempotent until
        `zero_grad`."""
        if self._reduced:
            return
        for store in self.stores.values():
            store.wait_for_gradients()
            if self.replica_group is not None and dist.get_world_size(self.replica_group) > 1:
                self._all_reduce(store.main_grad)
            if self.gradient_scale != 1.0:
                store.main_grad.mul_(self.gradient_scale)
        self._reduced = True

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
            store_squares = sum(torch.linalg.vector_norm(chunk, dtype=torch.float64).square()
                                for chunk in store.main_grad.view(-1).split(NORM_CHUNK))
            squares += store_squares.to(self.device)  # once per store, where it lives
        for group in self.norm_groups:
            dist.all_reduce(squares, group=group)
        return float(squares.sqrt())

    @torch.no_grad()
    def clip(self, coefficient: float) -> None:
        """Scale the gradients by ``coefficient`` (the engine's clip, from the global norm) when it is below 1."""
        if coefficient < 1.0:
            for store in self.stores.values():
                store.main_grad.mul_(coefficient)

    def step(self) -> None:
        """One `TableAdamW` update of every table, where it lives."""
        self.reduce_gradients()
        self.optimizer.step()
        self.steps += 1
