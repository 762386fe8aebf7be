"""Tables sharded by rows over a "memory-parallel" group, and the all-to-all row exchange.

Partition (`RowPartition`): every branch's ``M_b`` rows are split into ``N`` contiguous ranges,
rank ``r`` holding rows ``[r M_b // N, (r + 1) M_b // N)`` of every branch (sizes differ by at
most one row); its local buffer is those ranges one after another, in branch order.  Splitting each branch, rather than the
layer's buffer as a whole, spreads every branch over all ranks, so the hot unigram rows that
every token reads do not all land on one owner.  No rank ever holds a whole table.

Lookup of one microbatch (`RowLookup`, the memory analogue of MoE's token dispatch):

1. deduplicate the row indices locally (``torch.unique`` with the inverse);
2. send each unique request to its owner (an all-to-all of counts, then a variable-split
   all-to-all of the owners' local row ids);
3. each owner gathers the requested rows of its shard with the kernels of `fe_megatron.ops`;
4. the rows come back by a variable-split all-to-all, issued asynchronously so that a model
   can start every layer's lookup at the start of the microbatch (prefetch) and each layer
   waits only for its own rows;
5. the requester expands them with the inverse.

Backward mirrors it (`_RowShardedGather`): the gradients of duplicate positions are summed per
unique row (sorted, deterministic), sent back to the owners by all-to-all, and each owner adds
them into its shard's gradient, also sorted and deterministic, straight into ``main_grad``
under Megatron's DDP.  The table's gradient is never all-reduced.

Only ``torch.distributed`` is used here, so every engine (Megatron, DeepSpeed) shares it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fe_megatron import ops
from fe_megatron.memory.table_store import TableStore


@dataclass(frozen=True)
class RowPartition:
    """Which rows of a layer's table buffer each rank of the memory-parallel group holds."""

    branch_rows: tuple  # M_b, in branch order
    branch_offsets: tuple  # global first row of each branch
    size: int
    rank: int

    def __post_init__(self):
        smallest = min(self.branch_rows)
        if self.size > smallest:
            branch = self.branch_rows.index(smallest)
            raise ValueError(f"the memory-parallel group has {self.size} ranks but branch {branch} of this layer has "
                             f"only {smallest} rows; every rank must own rows of every branch. Use a smaller group "
                             "(parallel.table_sharding: replicated, or fewer data-parallel ranks) or larger tables")

    def branch_range(self, branch: int, rank: Optional[int] = None) -> tuple:
        """``(start, stop)`` of ``rank``'s rows of ``branch``, as rows of the branch."""
        rank = self.rank if rank is None else rank
        rows = self.branch_rows[branch]
        return rank * rows // self.size, (rank + 1) * rows // self.size

    def local_rows(self, rank: Optional[int] = None) -> int:
        return sum(stop - start for start, stop in (self.branch_range(b, rank) for b in range(len(self.branch_rows))))

    def slices(self, rank: Optional[int] = None) -> list:
        """``[(global_first_row, rows, local_first_row)]``: where each branch's range sits globally and locally."""
        out, local = [], 0
        for branch, offset in enumerate(self.branch_offsets):
            start, stop = self.branch_range(branch, rank)
            out.append((offset + start, stop - start, local))
            local += stop - start
        return out

    def locate(self, global_rows: torch.Tensor):
        """``(owner rank, row id in the owner's local buffer)`` of every global row id."""
        device = global_rows.device
        offsets = torch.tensor(self.branch_offsets, dtype=torch.int64, device=device)
        rows = torch.tensor(self.branch_rows, dtype=torch.int64, device=device)
        # local_first[r, b]: where branch b's range starts in rank r's buffer
        local_first = torch.tensor([[local for _, _, local in self.slices(r)] for r in range(self.size)],
                                   dtype=torch.int64, device=device)
        branch = torch.searchsorted(offsets, global_rows, right=True) - 1
        within, rows = global_rows - offsets[branch], rows[branch]
        owner = ((within + 1) * self.size + rows - 1) // rows - 1  # the largest r with r M // N <= within
        return owner, local_first[owner, branch] + within - owner * rows // self.size

    def take(self, full: torch.Tensor, rank: Optional[int] = None) -> torch.Tensor:
        """This rank's rows of a whole table ``full`` (for tests and small conversions)."""
        return torch.cat([full[first:first + rows] for first, rows, _ in self.slices(rank)])

    def gather_from(self, shards: list) -> torch.Tensor:
        """This rank's rows from the local buffers ``shards`` of a partition of the same rows over
        ``len(shards)`` ranks (a checkpoint saved at another group size).  Only the rows this rank
        owns are read, so memory-mapped shards are touched only where they overlap."""
        saved = RowPartition(self.branch_rows, self.branch_offsets, len(shards), 0)
        out = shards[0].new_empty((self.local_rows(),) + tuple(shards[0].shape[1:]))
        for first, rows, local in self.slices():
            for rank, shard in enumerate(shards):
                for saved_first, saved_rows, saved_local in saved.slices(rank):
                    lo, hi = max(first, saved_first), min(first + rows, saved_first + saved_rows)
                    if lo < hi:
                        out[local + lo - first:local + hi - first] = \
                            shard[saved_local + lo - saved_first:saved_local + hi - saved_first]
        return out

    def assemble(self, shards: list) -> torch.Tensor:
        """The whole table from every rank's local buffer, in rank order (inverse of `take`)."""
        total = sum(self.branch_rows)
        full = shards[0].new_empty((total,) + tuple(shards[0].shape[1:]))
        for rank, shard in enumerate(shards):
            for first, rows, local in self.slices(rank):
                full[first:first + rows] = shard[local:local + rows]
        return full


class RowLookup:
    """One layer's row lookup for one microbatch: requests sent, the rows on their way back.

    ``source`` is this rank's shard: the table's weight parameter, or a `TableStore` (a table
    trained by fe_megatron's own optimizer, in device or host memory), which serves the requested
    rows and receives their gradients.  Creating the lookup runs steps 1-3 of the module docstring
    and starts step 4; `rows` waits for the rows and expands them to ``[*indices.shape, width]``.
    """

    def __init__(self, source, indices: torch.Tensor, partition: RowPartition, group: dist.ProcessGroup):
        self.store = source if isinstance(source, TableStore) else None
        weight = source.weight if self.store is not None else source
        self.anchor = self.store.anchor if self.store is not None else source  # what autograd differentiates
        self.width, self.indices, self.partition, self.group = weight.shape[1], indices, partition, group
        flat = indices.reshape(-1)
        unique, self.inverse = torch.unique(flat, sorted=True, return_inverse=True)
        owner, local = partition.locate(unique)
        self.order = torch.argsort(owner, stable=True)  # requests grouped by owner
        self.send_counts = torch.bincount(owner, minlength=partition.size)
        self.recv_counts = torch.empty_like(self.send_counts)
        dist.all_to_all_single(self.recv_counts, self.send_counts, group=group)
        send_list, recv_list = self.send_counts.tolist(), self.recv_counts.tolist()
        self.requested = torch.empty(sum(recv_list), dtype=torch.int64, device=flat.device)
        dist.all_to_all_single(self.requested, local[self.order].contiguous(), recv_list, send_list, group=group)
        # the backward runs on autograd's thread, where ops.use_backend is not in force: keep the choice
        self.backend = ops.current_backend(flat.device, weight.dtype)
        with torch.no_grad():  # the rows this rank owns and was asked for
            if self.store is not None:
                self._served = self.store.fetch(self.requested, flat.device).wait()
            else:
                self._served = ops.gather_rows_forward(weight.detach(), self.requested, self.backend)
        self._received = self._served.new_empty((unique.numel(), self.width))
        self._work = dist.all_to_all_single(self._received, self._served, send_list, recv_list, group=group,
                                            async_op=True)
        self.stats = {"positions": flat.numel(), "unique": unique.numel(),
                      "sent_rows": sum(send_list) - send_list[partition.rank],
                      "served_rows": sum(recv_list) - recv_list[partition.rank]}

    def rows(self) -> torch.Tensor:
        """The looked-up rows, ``[*indices.shape, width]`` in fp32, differentiable in the table."""
        return _RowShardedGather.apply(self.anchor, self)

    def wait_unique_rows(self) -> torch.Tensor:
        """``[unique, width]`` in the order of the sorted unique ids (blocks until they arrived)."""
        if self._work is not None:
            self._work.wait()
            self._work, self._served = None, None
            unique_rows = torch.empty_like(self._received)
            unique_rows[self.order] = self._received
            self._received = unique_rows
        return self._received

    def exchange_gradients(self, grad_rows: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """Backward: sum ``grad_rows`` ([positions, width]) per unique row and send the sums to their
        owners; returns what this rank receives for its rows ``requested`` ([requested, width], fp32)."""
        unique_grad = torch.zeros(self.order.numel(), grad_rows.shape[1], dtype=torch.float32, device=grad_rows.device)
        ops.gather_rows_backward(grad_rows, self.inverse, unique_grad, deterministic, self.backend)
        received = torch.empty(self.requested.numel(), grad_rows.shape[1], dtype=torch.float32,
                               device=grad_rows.device)
        dist.all_to_all_single(received, unique_grad[self.order].contiguous(), self.recv_counts.tolist(),
                               self.send_counts.tolist(), group=self.group)
        return received


class _RowShardedGather(torch.autograd.Function):
    """``rows = lookup.rows()``, whose backward sends the row gradients to their owners.

    The owner adds them into its shard's gradient: into its `TableStore`'s ``main_grad``, or, for a
    weight parameter, as `fe_megatron.ops.gather_rows` does (straight into ``main_grad`` under
    Megatron's DDP, `fe_megatron.ops.table_weight_gradient`; elsewhere the dense gradient of the
    local shard, 1/N of the table).
    """

    @staticmethod
    def forward(ctx, anchor, lookup: RowLookup):
        ctx.lookup = lookup
        rows = lookup.wait_unique_rows().index_select(0, lookup.inverse).view(*lookup.indices.shape, lookup.width)
        return rows.float()  # a bf16 table's rows travel in bf16 and are exact in fp32

    @staticmethod
    def backward(ctx, grad_output):
        lookup = ctx.lookup
        grad_rows = grad_output.reshape(-1, lookup.width).float().contiguous()
        deterministic = ops.deterministic_backward()
        received = lookup.exchange_gradients(grad_rows, deterministic)
        if lookup.store is not None:
            lookup.store.accumulate(lookup.requested, received, deterministic, lookup.backend)
            return None, None
        return ops.table_weight_gradient(
            lookup.anchor, lambda out: ops.gather_rows_backward(received, lookup.requested, out, deterministic,
                                                                lookup.backend),
            dense_dtype=torch.float32), None
