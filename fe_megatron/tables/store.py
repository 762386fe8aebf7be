"""TableStore: a trained table kept outside the module's parameters, where its storage puts it.

The tables that fe_megatron's own optimizer trains (`fe_megatron.tables.stage_tables`: bf16
tables, the host tier, bf16 optimizer state) are not parameters of the training framework, whose
optimizers would keep fp32 copies of bf16 weights and whose wrappers would move every parameter to
the accelerator.  A `TableStore` holds such a table instead:

* ``weight`` [rows, width], fp32 or bf16, in device memory (``placement="device"``) or in host
  memory (``"host"``, ordinary pageable memory: only the small per-microbatch copies are pinned,
  since torch's pinned allocator would round a table up to the next power of two and never
  return it);
* ``main_grad`` beside it once training allocates one (`allocate_gradient`), fp32 or bf16: a
  dense accumulator, for the rules that update every row (AdamW); or, for the sparse rules
  (``optimizer.table_update``: ``rowwise_adagrad``, ``lazy_adam``), ``row_gradients``: a
  `RowGradients`, which keeps only the rows a step touched, so neither the accumulator nor its
  clearing costs a table's size;
* ``anchor``: a zero-size tensor that requires grad.  A lookup passes it to its autograd function
  so that autograd runs the lookup's backward, which adds the row gradients into ``main_grad``
  and returns nothing for the anchor (FBGEMM's table-batched embeddings use the same device).

Reading rows (`fetch`): from device memory, one gather; from host memory, a gather on the host
(the C++ kernel, which releases the GIL), a copy into a pinned staging buffer and a copy to the
device on a side stream, which the consumer waits for when it uses the rows
(`RowsInFlight.wait`), so the copy overlaps whatever the device runs meanwhile.  Writing
gradients (`accumulate`): into device memory at once; into host memory, a copy back on another
side stream and an addition on the host by one worker thread, in the order the gradients
arrived (so the result is the same as adding them at once); `wait_for_gradients` returns once
every addition is done, and must run before ``main_grad`` is read.

`StoreLookup` is one microbatch's lookup in a whole (not row-sharded) store; row-sharded stores
are read through the row exchange (`fe_megatron.tables.row_exchange`), which calls `fetch` and
`accumulate` on the rows each rank owns.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Optional

import torch

from fe_megatron import ops
from fe_megatron.tables.dedup import sum_per_row, unique_row_sums, unique_rows
from fe_megatron.tables.layout import TableLayout
from fe_megatron.tables.threads import GATHER, GRADIENT

_COPY_STREAMS: dict = {}
_WORKER: list = []
_LOCK = threading.Lock()


def _copy_stream(device: torch.device, direction: str):
    """A side stream per GPU and direction (``"to_device"``, ``"to_host"``) for the host tier's
    copies: rows going out do not queue behind gradients coming back, and each direction can use
    its own copy engine."""
    with _LOCK:
        if (device, direction) not in _COPY_STREAMS:
            _COPY_STREAMS[device, direction] = torch.cuda.Stream(device=device)
        return _COPY_STREAMS[device, direction]


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that adds row gradients into host-resident ``main_grad`` tensors, in order."""
    with _LOCK:
        if not _WORKER:
            _WORKER.append(concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fe-host-tables"))
        return _WORKER[0]


class RowsInFlight:
    """Rows on their way to ``device``; `wait` returns them, usable on the current stream."""

    def __init__(self, rows: torch.Tensor, event=None, staging: Optional[torch.Tensor] = None):
        self._rows, self._event, self._staging = rows, event, staging

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            stream = torch.cuda.current_stream(self._rows.device)
            stream.wait_event(self._event)
            self._rows.record_stream(stream)  # allocated on the copy stream, used on this one
            self._event, self._staging = None, None
        return self._rows


def copy_to_device(host: torch.Tensor, device: torch.device) -> RowsInFlight:
    """``host`` on ``device``: on a GPU through a pinned staging copy and asynchronously, on the CPU as is."""
    device = torch.device(device)
    if device.type != "cuda":
        return RowsInFlight(host.to(device))
    staging = host if host.is_pinned() else host.pin_memory()
    stream = _copy_stream(device, "to_device")
    with torch.cuda.stream(stream):
        rows = staging.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return RowsInFlight(rows, event, staging)


class RowGradients:
    """One step's gradient of a table kept by row: the pieces added during the step (each a
    microbatch's unique rows and their fp32 sums), coalesced into one sorted set of rows by
    `coalesce` (idempotent until `clear`).  Memory and work grow with the rows touched, not with
    the table."""

    def __init__(self, width: int, device: torch.device):
        self.width, self.device = width, device
        self.pieces: list = []
        self.ids: Optional[torch.Tensor] = None  # [U] int64, sorted local row ids (after coalesce)
        self.rows: Optional[torch.Tensor] = None  # [U, width] fp32

    def add(self, ids: torch.Tensor, grad_rows: torch.Tensor) -> None:
        if self.ids is not None:
            raise RuntimeError("row gradients were added after the step's gradients were coalesced")
        self.pieces.append((ids, grad_rows))

    def coalesce(self, deterministic: bool = True) -> tuple:
        """``(ids, rows)``: every row touched this step once, with its summed gradient."""
        if self.ids is None:
            if not self.pieces:
                ids = torch.zeros(0, dtype=torch.int64, device=self.device)
                rows = torch.zeros(0, self.width, dtype=torch.float32, device=self.device)
            elif len(self.pieces) == 1 and bool((self.pieces[0][0][1:] > self.pieces[0][0][:-1]).all()):
                ids, rows = (tensor.to(self.device) for tensor in self.pieces[0])  # one piece, sorted and unique
                rows = rows.float()
            else:
                ids, rows = unique_row_sums(torch.cat([i.to(self.device) for i, _ in self.pieces]),
                                            torch.cat([r.to(self.device, torch.float32) for _, r in self.pieces]),
                                            deterministic)
            self.ids, self.rows, self.pieces = ids, rows, []
        return self.ids, self.rows

    def replace(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """The step's coalesced gradient, after a reduction over replicas changed the row set."""
        self.ids, self.rows, self.pieces = ids, rows, []

    def clear(self) -> None:
        self.pieces, self.ids, self.rows = [], None, None


class TableStore:
    """One layer's table (or this rank's row shard of it) and its gradient, in ``placement``, and where its
    rows and columns sit in the whole table (``layout``, a `TableLayout`; None: the whole table)."""

    exchange_group = None  # the holder interface (`fe_megatron.tables.holders`): whole tables

    def __init__(self, weight: torch.Tensor, placement: str, layout: Optional[TableLayout] = None):
        if placement not in ("device", "host"):
            raise ValueError(f"placement {placement!r} is not one of ('device', 'host')")
        if placement == "host":
            weight = weight.detach().cpu()
        self.weight = weight.detach()
        self.placement, self.layout = placement, layout
        self.main_grad: Optional[torch.Tensor] = None
        self.row_gradients: Optional[RowGradients] = None
        self.anchor = torch.zeros(0, requires_grad=True)
        self._pending: list = []  # host tier: additions queued on the worker
        self.node = None  # node-shared tables: the node's segment (fe_megatron.tables.node_shared.NodeRows)

    @property
    def on_host(self) -> bool:
        return self.placement == "host"

    @torch.no_grad()
    def share_rows(self, view: torch.Tensor) -> None:
        """Keep the rows in ``view`` (this rank's slice of its node's shared segment,
        `fe_megatron.tables.node_shared`) from now on: they are copied there, and read and updated there."""
        if not self.on_host or view.shape != self.weight.shape or view.dtype != self.weight.dtype:
            raise ValueError(f"a shared slice of shape {tuple(view.shape)} ({view.dtype}) cannot hold this store's "
                             f"{self.placement} rows of shape {tuple(self.weight.shape)} ({self.weight.dtype})")
        view.copy_(self.weight)
        self.weight = view

    def allocate_gradient(self, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed ``main_grad`` of ``dtype`` beside the rows."""
        self.main_grad = torch.zeros(self.weight.shape, dtype=dtype, device=self.weight.device)
        return self.main_grad

    def allocate_row_gradients(self) -> RowGradients:
        """Gradients kept by row (`RowGradients`, fp32) instead of a dense ``main_grad``."""
        self.row_gradients = RowGradients(self.weight.shape[1], self.weight.device)
        return self.row_gradients

    @property
    def sparse(self) -> bool:
        return self.row_gradients is not None

    # ----------------------------------------------------------------- the holders' interface (tables/holders.py)
    @property
    def outside_module(self) -> dict:
        """The rows, which are no parameter or buffer of the module that reads them."""
        return {"weight": self.weight}

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """The rows of ``indices`` in fp32, on the indices' device, differentiable through the store."""
        return StoreLookup(self, indices, indices.device).rows()

    def start_lookup(self, indices: torch.Tensor, device) -> "StoreLookup":
        """A whole store's lookup of ``indices``, started now (`StoreLookup`)."""
        return StoreLookup(self, indices, device)

    @torch.no_grad()
    def initialize(self, draw) -> None:
        draw(self.weight)

    # ----------------------------------------------------------------- reading rows
    def fetch(self, ids: torch.Tensor, device: torch.device) -> RowsInFlight:
        """Rows ``ids`` ([M] int64, on any device) in the stored dtype, on their way to ``device``."""
        with GATHER.threads_for(ids.numel() * self.weight.shape[1], self.weight.device):
            if not self.on_host:
                return RowsInFlight(ops.gather_rows_forward(self.weight, ids.to(self.weight.device)))
            host_ids = ids.cpu()
            rows = ops.gather_rows_forward(self.weight, host_ids, ops.fastest_backend(host_ids.device,
                                                                                      self.weight.dtype))
        return copy_to_device(rows, device)

    # ----------------------------------------------------------------- writing gradients
    def accumulate(self, ids: torch.Tensor, grad_rows: torch.Tensor, deterministic: bool = True,
                   backend: Optional[str] = None) -> None:
        """``main_grad[ids[m]] += grad_rows[m]`` ([M] ids, [M, width] fp32 rows).  In host memory the
        addition happens on the worker thread: call `wait_for_gradients` before reading ``main_grad``.
        With `RowGradients` the rows are kept as a piece of the step's gradient instead (``ids``
        unique, as the lookups pass them, or summed per unique row first)."""
        if self.main_grad is None and self.row_gradients is None:
            raise RuntimeError("this table has no gradient accumulator: training allocates one "
                               "(fe_megatron.tables.stage_tables.StageTables)")
        if not self.on_host:
            with GRADIENT.threads_for(grad_rows.numel(), grad_rows.device):
                if self.sparse:
                    self.row_gradients.add(*unique_row_sums(ids, grad_rows, deterministic, backend))
                else:
                    ops.gather_rows_backward(grad_rows, ids, self.main_grad, deterministic, backend)
            return
        host_ids = ids.cpu()
        device = grad_rows.device
        if device.type == "cuda":
            stream = _copy_stream(device, "to_host")
            stream.wait_stream(torch.cuda.current_stream(device))  # the gradient is computed there
            with torch.cuda.stream(stream):
                host_rows = torch.empty(grad_rows.shape, dtype=grad_rows.dtype, pin_memory=True)
                host_rows.copy_(grad_rows, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            grad_rows.record_stream(stream)
        else:
            host_rows, event = grad_rows, None
        main_grad, row_gradients = self.main_grad, self.row_gradients
        backend = ops.fastest_backend(host_rows.device, torch.float32 if self.sparse else main_grad.dtype)

        def add():
            if event is not None:
                with torch.cuda.device(device):  # this rank's GPU: no context on GPU 0 from the worker thread
                    event.synchronize()
            with GRADIENT.threads_for(host_rows.numel(), host_rows.device):
                if row_gradients is not None:
                    row_gradients.add(*unique_row_sums(host_ids, host_rows, deterministic, backend))
                else:
                    ops.gather_rows_backward(host_rows, host_ids, main_grad, deterministic, backend)

        self._pending.append(_worker().submit(add))

    def wait_for_gradients(self) -> None:
        """Block until every queued addition into ``main_grad`` is done (re-raising its error)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()


class StartedLookup:
    """The one lookup protocol: one layer's lookup of one forward's rows, started by
    ``start_lookup(indices)`` (`fe_megatron.memory.branch.MemoryBranch.start_lookup`): ``indices`` (the row
    ids it looks up, ``[..., branches]``) and `rows` (those rows, ``[..., branches, width]``, differentiable
    in a trained table; fp32 from a store). A lookup started ahead is read once. `StoreLookup` here (a whole
    `TableStore`), `LayerRowLookup` (a layer's part of a row exchange) in `fe_megatron.tables.row_exchange`,
    and `ModuleLookup` (rows the module holds: the engine's parameter, read-only serving rows) in
    `fe_megatron.tables.holders`. Which starts when: `fe_megatron.memory.inputs`."""

    indices: torch.Tensor

    def rows(self) -> torch.Tensor:
        raise NotImplementedError


class StoreLookup(StartedLookup):
    """One layer's lookup of one microbatch in a whole `TableStore`, started ahead of use.

    In host memory the lookup is deduplicated: the unique rows are gathered on the host and copied
    to ``device`` (asynchronously on a GPU), then expanded there with the inverse; their gradient is
    summed per unique row on the device before it travels back.  In device memory it is one gather.
    Pass ``indices`` on the host to keep the host tier free of device synchronizations.
    """

    def __init__(self, store: TableStore, indices: torch.Tensor, device: torch.device):
        self.store, self.indices, self.device = store, indices, torch.device(device)
        self.deterministic = ops.deterministic_backward()
        # the forward's backend, also when a use_backend block has ended before the backward runs
        self.backend = ops.current_backend(self.device, store.weight.dtype)
        flat = indices.reshape(-1)
        if store.on_host:
            unique, inverse = unique_rows(flat.cpu())
            self.unique, self._inverse = unique, copy_to_device(inverse, self.device)
            self._rows = store.fetch(unique, self.device)
            self.stats = {"positions": flat.numel(), "unique": unique.numel()}
        else:
            self.flat = flat.to(self.device)

    def rows(self) -> torch.Tensor:
        """``[*indices.shape, width]`` in fp32, differentiable through the store (its ``anchor``)."""
        return _StoreGather.apply(self.store.anchor, self)


class _StoreGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, lookup: StoreLookup):
        ctx.lookup = lookup
        store, width = lookup.store, lookup.store.weight.shape[1]
        if store.on_host:
            if lookup._rows is None:
                raise RuntimeError("this host-tier lookup's rows were read already; a started lookup is read once. "
                                   "Where a layer runs twice (recompute), schedule its addresses, not a lookup "
                                   "started ahead (fe_megatron.memory.inputs.schedule_lookups, recomputed=True)")
            lookup.inverse = lookup._inverse.wait()
            unique = lookup._rows.wait()
            with GATHER.threads_for(lookup.inverse.numel() * width, unique.device):
                rows = unique.index_select(0, lookup.inverse)
            lookup._rows = None  # the unique rows are no longer needed
        else:
            with GATHER.threads_for(lookup.flat.numel() * width, store.weight.device):
                rows = ops.gather_rows_forward(store.weight, lookup.flat, lookup.backend)
        return rows.float().view(*lookup.indices.shape, width)

    @staticmethod
    def backward(ctx, grad_output):
        lookup = ctx.lookup
        store = lookup.store
        grad_rows = grad_output.reshape(-1, store.weight.shape[1]).float().contiguous()
        if store.on_host:
            with GRADIENT.threads_for(grad_rows.numel(), grad_rows.device):
                unique_grad = sum_per_row(grad_rows, lookup.inverse, lookup.unique.numel(), lookup.deterministic,
                                          lookup.backend)
            store.accumulate(lookup.unique, unique_grad, lookup.deterministic)
        else:
            store.accumulate(lookup.flat, grad_rows, lookup.deterministic, lookup.backend)
        return None, None
