"""TableAdamW: AdamW for n-gram tables and optimizer state stored in fp32 or bf16.

The update is torch's AdamW (decoupled weight decay, bias-corrected moments), computed in fp32
a block of rows at a time, so the scratch is a block's, not a table's.  An fp32 table with fp32
moments takes it as torch's single-tensor AdamW does, to the bit.  What is stored in bf16 is read
as fp32, updated and written back with stochastic rounding (`fe_megatron.tables.storage`),
so updates far below a bf16 step still move the rows in expectation; rounding to nearest would
drop them.

Optimizer state precision (``state_dtype``, ``optimizer.table_state_dtype``): fp32 moments, as
FBGEMM's and TorchRec's low-precision tables keep by default (8 bytes per table parameter), or
bf16 moments (4 bytes), stochastically rounded like the rows.  The optimizers train
`fe_megatron.tables.store.TableStore`s: the gradient is the store's (its dense ``main_grad``, fp32
or bf16, or its ``row_gradients`` for the sparse rules), and so is the `TableLayout`; nothing is
read from attributes of the rows' tensor.

The rounding's random bits are a counter-based function of the training seed, the table, the
step, and each element's global coordinates (`TableLayout`): a table is rounded the same at every
data-, tensor- and row-parallel layout, and a resumed run rounds as the uninterrupted one did,
with no generator state to checkpoint.  The state dict has torch AdamW's layout (``step``,
``exp_avg``, ``exp_avg_sq``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fe_megatron import ops
from fe_megatron.tables.layout import TableLayout
from fe_megatron.tables.storage import rounding_keys
from fe_megatron.tables.store import TableStore
from fe_megatron.tables.threads import UPDATE
from fe_megatron.ops import reference

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class StateEntry:
    """One tensor of a rule's optimizer state: ``key`` (torch's state-dict key), and one fp32 value per
    row (``per_row``, as FBGEMM keeps row-wise state) or one value per table parameter in
    ``optimizer.table_state_dtype``."""

    key: str
    per_row: bool = False

    def bytes_per_parameter(self, width: int, state_dtype: str) -> float:
        """Bytes per table parameter (rows of ``width`` columns on a rank)."""
        return 4 / width if self.per_row else DTYPE_BYTES[state_dtype]


class TableOptimizerBase(torch.optim.Optimizer):
    """What every table optimizer shares (`TableAdamW` here, the sparse rules of
    `fe_megatron.tables.sparse_update`): it trains `TableStore`s (``tables``: a list of them, or torch's
    parameter groups whose ``params`` are stores), each [rows, width] in fp32 or bf16, with the store's
    gradient and `TableLayout` (whole, at its index, where the store has none); state of
    ``state_entries`` created for a table that has none (`initialize_state`: what a checkpoint is loaded
    into) and kept in its own dtype when loaded; and the global row of every local row, for the
    rounding's keys.  Its parameter groups and state are keyed by the stores' rows, as torch's are by
    parameters, so its state dict is torch's."""

    state_entries: tuple = ()  # StateEntry of every state tensor

    @property
    def state_keys(self) -> tuple:
        return tuple(entry.key for entry in self.state_entries)

    def __init__(self, tables, defaults: dict, state_dtype: str = "fp32", seed: int = 0):
        groups = store_groups(tables, type(self).__name__)
        super().__init__([dict(group, params=[store.weight for store in group["params"]]) for group in groups],
                         defaults)
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype {state_dtype!r} is not one of {tuple(STATE_DTYPES)}")
        self.state_dtype, self.seed = STATE_DTYPES[state_dtype], seed
        self._global_rows = {}
        self.stores, self.layouts = {}, {}  # the rows (torch's key) -> their store, and its layout
        stores = [store for group in groups for store in group["params"]]
        for index, (param, store) in enumerate(zip(self._params(), stores)):
            if param.dtype not in (torch.float32, torch.bfloat16) or param.dim() != 2:
                raise TypeError(f"{type(self).__name__} updates fp32 or bf16 tables [rows, width]; got a "
                                f"{param.dtype} table of shape {tuple(param.shape)}")
            self.stores[param] = store
            self.layouts[param] = store.layout if store.layout is not None else TableLayout.whole(index, param)

    def _params(self) -> list:
        return [param for group in self.param_groups for param in group["params"]]

    @classmethod
    def for_tables(cls, groups: list, *, lr: float, betas: tuple, eps: float, weight_decay: float,
                   state_dtype: str, seed: int, row_group=None) -> "TableOptimizerBase":
        """The optimizer from a run's settings (`fe_megatron.tables.update_rules.UpdateRule.build`); a rule
        that takes fewer settings ignores the others."""
        return cls(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_dtype=state_dtype, seed=seed)

    def new_state(self, param: torch.Tensor) -> dict:
        """``{key: zeros}`` of ``state_entries`` for ``param``: fp32 [rows] per row, else ``param``'s shape
        in ``state_dtype``."""
        return {entry.key: torch.zeros(param.shape[0], dtype=torch.float32, device=param.device) if entry.per_row
                else torch.zeros(param.shape, dtype=self.state_dtype, device=param.device)
                for entry in self.state_entries}

    def stored_state(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """A loaded state tensor as this optimizer keeps it: per-parameter state in ``state_dtype``;
        per-row state in fp32, one value per row (Megatron's checkpoints hold it as [rows, 1], or, for
        ``rowwise_adagrad`` before that, repeated across the row's columns: either is read from its
        first column)."""
        if next(entry for entry in self.state_entries if entry.key == key).per_row:
            return (value[:, 0] if value.dim() == 2 else value).float()
        return value.to(self.state_dtype)

    def initialize_state(self, params=None) -> None:
        """Zero state and step 0 for every table (of ``params``) that has none: what a checkpoint
        is loaded into, and a table's state before its first update."""
        for param in self._params() if params is None else params:
            if not self.state[param]:
                self.state[param].update(step=torch.tensor(0.0), **self.new_state(param))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the state keeps its own dtype (torch casts it to the table's)."""
        super().load_state_dict(state_dict)
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        for pid, param in zip(saved_ids, self._params()):
            saved = state_dict["state"].get(pid)
            if saved is not None:
                for key in self.state_keys:
                    self.state[param][key] = self.stored_state(key, saved[key].to(param.device)).contiguous()

    def global_rows(self, param: torch.Tensor) -> torch.Tensor:
        """The global row of each of ``param``'s local rows (on its device), cached."""
        rows = self._global_rows.get(id(param))
        if rows is None:
            rows = self._global_rows[id(param)] = self.layouts[param].global_rows().to(param.device)
        return rows


def store_groups(tables, optimizer: str) -> list:
    """``tables`` as torch's parameter groups of `TableStore`s; anything else is refused by name."""
    tables = list(tables)
    groups = [dict(group, params=list(group["params"])) for group in tables] \
        if tables and isinstance(tables[0], dict) else [{"params": tables}]
    for group in groups:
        for store in group["params"]:
            if not isinstance(store, TableStore):
                raise TypeError(f"{optimizer} trains TableStores (fe_megatron.tables.store.TableStore: the rows, their "
                                f"gradient and their layout); got a {type(store).__name__}. Hand it the table as "
                                "TableStore(weight, 'device'), or train the tables through "
                                "fe_megatron.tables.stage_tables.StageTables")
    return groups


class TableAdamW(TableOptimizerBase):
    state_entries = (StateEntry("exp_avg"), StateEntry("exp_avg_sq"))

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 state_dtype: str = "fp32", seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), state_dtype,
                         seed)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                grad = self.stores[param].main_grad
                if grad is None:
                    continue
                self.initialize_state([param])
                state = self.state[param]
                state["step"] += 1
                step = int(state["step"].item())
                with UPDATE.threads_for(param.numel(), param.device):
                    self._update(param, grad, state["exp_avg"], state["exp_avg_sq"], step, group)
        return None

    def _update(self, param, grad, exp_avg, exp_avg_sq, step: int, group: dict) -> None:
        """One table's update: torch's AdamW a block of rows at a time for fp32 tables and state (to
        the bit), else the fused kernel (`fe_megatron.ops.table_adamw_`: on host memory the C++ one),
        each bf16 tensor written back with stochastic rounding keyed by its elements' global ids."""
        layout, global_rows = self.layouts[param], self.global_rows(param)
        keys = torch.tensor([rounding_keys((self.seed, layout.table, step, which)) for which in range(3)])
        settings = dict(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                        weight_decay=group["weight_decay"], step=step)
        exact = param.dtype == torch.float32 and self.state_dtype == torch.float32
        (reference.table_adamw_ if exact else ops.table_adamw_)(
            param, grad.contiguous(), exp_avg, exp_avg_sq, global_rows, layout.column_offset, layout.global_width,
            keys, **settings)
