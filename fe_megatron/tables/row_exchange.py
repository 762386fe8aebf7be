"""Tables sharded by rows over a "memory-parallel" group, and the all-to-all row exchange.

Partition (`RowPartition`): every branch's ``M_b`` rows are split into ``N`` contiguous ranges,
rank ``r`` holding rows ``[r M_b // N, (r + 1) M_b // N)`` of every branch (sizes differ by at
most one row); its local buffer is those ranges one after another, in branch order.  Splitting each branch, rather than the
layer's buffer as a whole, spreads every branch over all ranks, so the hot unigram rows that
every token reads do not all land on one owner.  No rank ever holds a whole table.

Lookup of one microbatch (`StageRowExchange`, the memory analogue of MoE's token dispatch), for
one layer (`row_lookup`) or every row-sharded layer of a pipeline stage at once:

1. deduplicate each layer's row indices locally (`fe_megatron.tables.dedup`: the distinct ids and
   the inverse);
2. send each unique request to its owner (an all-to-all of counts, then a variable-split
   all-to-all of the owners' local row ids, every layer's in one buffer);
3. each owner gathers the requested rows of its shards with the kernels of `fe_megatron.ops`;
4. the rows come back by a variable-split all-to-all, issued asynchronously so that a model
   can start the lookups at the start of the microbatch (prefetch) and each layer waits only
   for the rows to arrive;
5. the requester expands each layer's rows with its inverse.

Backward mirrors it: the gradients of duplicate positions are summed per unique row (sorted,
deterministic), sent back to the owners by all-to-all, and each owner adds them into its
shard's gradient (its `TableStore`'s), also sorted and deterministic.  The table's gradient is
never all-reduced.

Node-shared tables (`fe_megatron.tables.node_shared`): the same exchange, except that a rank reads the
rows its node's ranks own from the node's shared segment (after the counts' all-to-all, so after every
owner's last update), and rows travel in step 4 only between nodes; requests and gradients go to every
owner as above, so the arithmetic is the row-sharded one.

Only ``torch.distributed`` is used here, so every engine (Megatron, DeepSpeed) shares it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fe_megatron import ops
from fe_megatron.tables.dedup import sum_per_row, unique_rows
from fe_megatron.tables.store import StartedLookup, TableStore


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


def row_lookup(store: TableStore, indices: torch.Tensor, partition: RowPartition,
               group: dist.ProcessGroup) -> "LayerRowLookup":
    """One layer's row lookup for one microbatch, exchanged alone: a `StageRowExchange` of that
    layer.  ``store``: this rank's shard (a `TableStore`, in device or host memory)."""
    return StageRowExchange([store], [indices], [partition], group).layer_lookup(0)


def _check_stores(stores: list) -> None:
    """Row-sharded tables are read from their `TableStore`s: refuse a layer whose shard is not one."""
    for layer, store in enumerate(stores):
        if not isinstance(store, TableStore):
            what = "has no store" if store is None else f"is a {type(store).__name__}"
            raise TypeError(f"the row exchange reads row-sharded tables from their TableStores; layer {layer}'s "
                            f"shard {what}. Row-sharded tables train from stores: "
                            "fe_megatron.tables.stage_tables.StageTables moves them there")


def _common_width(weights: list) -> int:
    """The tables' row width: the layers exchanged together share one buffer, so one width and one dtype."""
    widths, dtypes = {w.shape[1] for w in weights}, {w.dtype for w in weights}
    if len(widths) != 1 or len(dtypes) != 1:
        raise ValueError(f"the layers exchanged together must share the tables' width and dtype; got widths "
                         f"{sorted(widths)} and dtypes {sorted(map(str, dtypes))}")
    return widths.pop()


class StageRowExchange:
    """The row lookups of every memory layer of a pipeline stage for one microbatch, exchanged
    together: one all-to-all of counts (the one device synchronization), one of requests and one
    of rows in forward, and one of gradients in backward, whatever the number of layers.

    Each layer's indices are deduplicated against themselves (each layer has its own tables); the
    requests of all layers travel in one buffer, grouped by owner and, within an owner, by layer.
    An owner serves each layer's requests from that layer's shard.  `layer_lookup` gives each
    layer its view (`LayerRowLookup`), which the layer's branch takes as a started lookup.

    Backward: each layer sums its positions' gradients per unique row when autograd reaches it; the
    sums wait until the last layer of the stage (the first in forward order) has delivered its own,
    and one all-to-all sends them all to their owners, which add them into their stores.

    Row-sharded tables are always trained from `TableStore`s (the table plan puts them there), so a
    shard is a store: its gradient is taken after its layer's backward has returned.
    """

    def __init__(self, stores: list, indices: list, partitions: list, group: dist.ProcessGroup):
        _check_stores(stores)
        self.stores = list(stores)
        self.weights = [store.weight for store in self.stores]
        self.width = _common_width(self.weights)
        self.indices, self.partitions, self.group = indices, partitions, group
        self.layers, self.world = len(stores), partitions[0].size
        device = indices[0].device
        owner, layer_of, local = self._locate_requests()
        recv_layer = self._send_requests(owner, layer_of, local)
        self.backend = ops.current_backend(device, self.weights[0].dtype)
        me = dist.get_rank(group)
        node = self.stores[0].node  # node-shared tables (fe_megatron.tables.node_shared): the node's rows
        same_node = [False] * self.world if node is None else node.same_node.tolist()
        rows_in = [0 if same_node[o] else n for o, n in enumerate(self.send_split)]  # from each owner
        rows_out = [0 if same_node[r] else n for r, n in enumerate(self.recv_split)]  # to each requester
        with torch.no_grad():
            served = self._serve_requests(recv_layer, same_node, sum(rows_out))
            # and the rows of this node's owners, read from the node's segment (after the counts' exchange:
            # every rank of the group has finished its last update)
            self._node_reads, self._remote_positions = [], None
            if node is not None:
                self._read_node_rows(node, owner, layer_of, local)
        self._received = served.new_empty((sum(rows_in), self.width))
        self._work = None
        if not all(same_node):  # rows cross between nodes (row-sharded tables: between every two ranks)
            self._work = dist.all_to_all_single(self._received, served, rows_in, rows_out, group=group, async_op=True)
        self._unique_rows = None
        self._pending_grads = [None] * self.layers
        self.exchanges = {"forward": 2 + (self._work is not None), "backward": 0}  # all-to-alls issued
        # rows sent to and received from other ranks (the rank itself excluded), for tests and benchmarks
        self.rows_moved = {"forward_out": sum(rows_out) - rows_out[me], "forward_in": sum(rows_in) - rows_in[me],
                           "gradients_out": sum(self.send_split) - self.send_split[me]}

    def _locate_requests(self) -> tuple:
        """Deduplicate each layer's indices (keeping the inverses and the unique counts) and find each unique
        row's owner.  Returns ``(owner, layer, row id in the owner's buffer)`` of every request, layer by layer."""
        device = self.indices[0].device
        self.inverses, self.unique_counts, owners, locals_ = [], [], [], []
        for flat, partition in zip((i.reshape(-1) for i in self.indices), self.partitions):
            unique, inverse = unique_rows(flat)
            owner, local = partition.locate(unique)
            self.inverses.append(inverse)
            self.unique_counts.append(unique.numel())
            owners.append(owner)
            locals_.append(local)
        layer_of = torch.repeat_interleave(torch.arange(self.layers, device=device),
                                           torch.tensor(self.unique_counts, device=device))
        return torch.cat(owners), layer_of, torch.cat(locals_)

    def _send_requests(self, owner: torch.Tensor, layer_of: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Send every request to its owner: the all-to-all of the counts (per owner and layer), then that of the
        owners' row ids.  Keeps the requests' order, counts and splits, and the requests this rank received
        (``requested``); returns the layer of each received request."""
        layers, world, device = self.layers, self.world, self.indices[0].device
        key = owner * layers + layer_of  # requests grouped by owner, then by layer
        self.order = torch.argsort(key, stable=True)
        self.send_counts = torch.bincount(key, minlength=world * layers)  # [owner x layer]
        self.recv_counts = torch.empty_like(self.send_counts)
        dist.all_to_all_single(self.recv_counts, self.send_counts, group=self.group)
        send, recv = self.send_counts.view(world, layers), self.recv_counts.view(world, layers)
        self.send_split, self.recv_split = send.sum(1).tolist(), recv.sum(1).tolist()
        self.requested = torch.empty(sum(self.recv_split), dtype=torch.int64, device=device)
        dist.all_to_all_single(self.requested, local[self.order].contiguous(), self.recv_split,
                               self.send_split, group=self.group)
        recv_layer = torch.repeat_interleave(torch.arange(layers, device=device).repeat(world), self.recv_counts)
        self.served_positions = [(recv_layer == l).nonzero().flatten() for l in range(layers)]
        return recv_layer

    def _serve_requests(self, recv_layer: torch.Tensor, same_node: list, rows_out: int) -> torch.Tensor:
        """The rows this rank sends back, in request order, fetched from each layer's store: those of every
        request it received, or (node-shared) only those of other nodes' ranks."""
        device = self.indices[0].device
        served_layer, served_ids = recv_layer, self.requested
        if self.stores[0].node is not None:
            serves = torch.repeat_interleave(torch.tensor([not s for s in same_node], device=device),
                                             torch.tensor(self.recv_split, device=device))
            served_layer, served_ids = recv_layer[serves], self.requested[serves]
        served = torch.empty(rows_out, self.width, dtype=self.weights[0].dtype, device=device)
        for l in range(self.layers):
            positions = (served_layer == l).nonzero().flatten()
            if positions.numel():
                served.index_copy_(0, positions, self.stores[l].fetch(served_ids.index_select(0, positions),
                                                                      device).wait())
        return served

    def _read_node_rows(self, node, owner: torch.Tensor, layer_of: torch.Tensor, local: torch.Tensor) -> None:
        """Node-shared tables: start reading the rows this node's owners hold from the node's segment, and note
        where the rows other nodes send go among the unique rows."""
        device = self.indices[0].device
        sorted_owner, sorted_layer = owner[self.order], layer_of[self.order]
        sorted_local = local[self.order]
        from_node = node.same_node.to(device)[sorted_owner]
        # where each row goes among the unique rows (requests are in owner order; rows in id order)
        self._remote_positions = self.order[~from_node]
        for l in range(self.layers):
            positions = (from_node & (sorted_layer == l)).nonzero().flatten()
            if positions.numel():
                self._node_reads.append((self.order.index_select(0, positions), self.stores[l].node.read(
                    sorted_owner.index_select(0, positions), sorted_local.index_select(0, positions), device)))

    def layer_lookup(self, layer: int) -> "LayerRowLookup":
        return LayerRowLookup(self, layer)

    def unique_rows(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s unique rows, ``[unique, width]`` in sorted-id order (blocks until they arrived)."""
        if self._unique_rows is None:
            if self._work is not None:
                self._work.wait()
            # the rows arrived in request order (by owner, then layer): put each at its unique id's place
            self._unique_rows = self._received.new_empty((sum(self.unique_counts), self.width))
            if self._remote_positions is None:
                self._unique_rows[self.order] = self._received
            else:  # node-shared: the rows other nodes sent, and those read from the node's segment
                self._unique_rows.index_copy_(0, self._remote_positions, self._received)
                for positions, rows in self._node_reads:
                    self._unique_rows.index_copy_(0, positions, rows.wait())
            self._received, self._work, self._node_reads = None, None, []
        start = sum(self.unique_counts[:layer])
        return self._unique_rows[start:start + self.unique_counts[layer]]

    def backward(self, layer: int, grad_rows: torch.Tensor, deterministic: bool):
        """Layer ``layer``'s positions' gradients ([positions, width] fp32), kept until the stage's last
        layer has delivered its own; then every layer's are sent to the rows' owners and added into their
        stores."""
        unique_grad = sum_per_row(grad_rows, self.inverses[layer], self.unique_counts[layer], deterministic,
                                  self.backend)
        self._pending_grads[layer] = unique_grad
        if all(grad is not None for grad in self._pending_grads):
            grads, self._pending_grads = torch.cat(self._pending_grads), [None] * self.layers
            received = torch.empty(self.requested.numel(), self.width, dtype=torch.float32, device=grads.device)
            dist.all_to_all_single(received, grads[self.order].contiguous(), self.recv_split, self.send_split,
                                   group=self.group)
            self.exchanges["backward"] += 1
            for l, positions in enumerate(self.served_positions):
                self.stores[l].accumulate(self.requested.index_select(0, positions),
                                          received.index_select(0, positions), deterministic, self.backend)


class LayerRowLookup(StartedLookup):
    """One layer's part of a `StageRowExchange`: its indices, and its rows (differentiable in the table)."""

    def __init__(self, exchange: StageRowExchange, layer: int):
        self.exchange, self.layer = exchange, layer
        self.indices = exchange.indices[layer]
        self.anchor = exchange.stores[layer].anchor

    def rows(self) -> torch.Tensor:
        return _StageGather.apply(self.anchor, self)


class _StageGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, lookup: LayerRowLookup):
        ctx.lookup = lookup
        exchange, layer = lookup.exchange, lookup.layer
        rows = exchange.unique_rows(layer).index_select(0, exchange.inverses[layer])
        return rows.view(*lookup.indices.shape, exchange.width).float()

    @staticmethod
    def backward(ctx, grad_output):
        lookup = ctx.lookup
        grad_rows = grad_output.reshape(-1, lookup.exchange.width).float().contiguous()
        lookup.exchange.backward(lookup.layer, grad_rows, ops.deterministic_backward())
        return None, None
