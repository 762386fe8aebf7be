"""Sparse table updates: only the rows a step touched (``optimizer.table_update``).

The paper trains its tables with AdamW over every row, every step (`TableAdamW`, the default,
``adamw``).  A batch touches a small part of a large table, and dense AdamW still reads and
writes every row's weight, gradient and two moments: at the paper's 340M preset that is 1.1B
parameters updated per step for the few hundred thousand rows a batch addressed.  The two rules
here, as FBGEMM and TorchRec train production embedding tables, update only the touched rows, so
their cost grows with the unique rows of a step, not with the table:

* ``rowwise_adagrad`` (`RowwiseAdagrad`): FBGEMM's ``EXACT_ROWWISE_ADAGRAD``.  One fp32
  accumulator per row, ``G_r += mean_c(g_rc^2)``, and ``w_r -= lr * g_r / (sqrt(G_r) + eps)``.
  Its state is 4 bytes per row instead of Adam's 8 per parameter (at ``s_b = 128``: 1/256 of
  it).  Under tensor parallelism the mean runs over the whole row (a sum over the
  tensor-parallel ranks' columns), so every layout computes the single-process update.
* ``lazy_adam`` (`LazyAdam`): Adam's moments updated for the touched rows only, as
  `torch.optim.SparseAdam` does (its formula exactly, bias corrections by the global step);
  untouched rows keep their moments and weights, rather than decaying the moments and moving by
  the momentum as dense Adam would.
* ``partial_rowwise_adam`` (`PartialRowwiseAdam`): FBGEMM's ``PARTIAL_ROWWISE_ADAM``.  Adam's first
  moment per element, its second moment per row, of the row's mean squared gradient:
  ``m_rc = b1 m_rc + (1 - b1) g_rc``, ``v_r = b2 v_r + (1 - b2) mean_c(g_rc^2)``,
  ``w_rc -= lr (m_rc / (1 - b1^t)) / (sqrt(v_r / (1 - b2^t)) + eps)``: one moment per parameter and
  4 bytes per row, a little over half of Adam's state.  The mean runs over the whole row as
  ``rowwise_adagrad``'s does.

Each rule declares its state (`StateEntry`: one value per row or per parameter, its dtype); the
registry of rules (`fe_megatron.tables.update_rules`) derives the bytes, the sharding and the
checkpoint keys from it.

Weight decay, where the run sets it (``optimizer.weight_decay x table_weight_decay_mult``), is
decoupled (``w -= lr * wd * w``, as AdamW's) and applied to the touched rows only: the rows a
step did not read are left as they are, the rule FBGEMM's and TorchRec's sparse optimizers follow.

The gradient is the step's `fe_megatron.tables.store.RowGradients` (the store's ``row_gradients``:
sorted local row ids and their fp32 sums, after the replicas' reduction and the clip).  bf16
tables (and bf16 per-parameter moments) are read as fp32, updated, and written back with
stochastic rounding keyed as `TableAdamW`'s, by the seed, the table, the step and the element's
global coordinates, so every parallel layout rounds alike.  Per-row state (``rowwise_adagrad``'s
accumulator, ``partial_rowwise_adam``'s second moment) is always fp32, as FBGEMM keeps it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from fe_megatron import ops
from fe_megatron.ops import reference
from fe_megatron.tables.optimizer import StateEntry, TableOptimizerBase
from fe_megatron.tables.storage import rounding_keys
from fe_megatron.tables.threads import UPDATE


class SparseTableOptimizer(TableOptimizerBase):
    """What the sparse rules share: the touched rows' gradients (``row_gradients``), the step count,
    the row-wise mean square over the whole row, and writing updated rows back in the table's dtype.

    ``row_group``: the ranks holding the other columns of the same rows (tensor parallelism), over
    which a row's squared gradient is summed; the table's layout's ``global_width`` is the row's
    whole width."""

    def __init__(self, params, defaults: dict, state_dtype: str = "fp32", seed: int = 0,
                 row_group: Optional[dist.ProcessGroup] = None):
        super().__init__(params, defaults, state_dtype, seed)
        self.row_group = row_group

    @classmethod
    def for_tables(cls, groups, *, lr, betas, eps, weight_decay, state_dtype, seed, row_group=None):
        return cls(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_dtype=state_dtype, seed=seed,
                   row_group=row_group)

    @property
    def whole_rows(self) -> bool:
        """Whether this rank holds every column of its rows (no tensor-parallel split to sum squares over)."""
        return self.row_group is None or dist.get_world_size(self.row_group) == 1

    def row_mean_square(self, param, grad: torch.Tensor) -> torch.Tensor:
        """``mean_c(g_rc^2)`` of each touched row ([U] fp32), over the whole row under tensor parallelism."""
        squares = grad.square().sum(dim=1)
        if not self.whole_rows:
            dist.all_reduce(squares, group=self.row_group)
        return squares / self.layouts[param].global_width

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                gradients = self.stores[param].row_gradients
                if gradients is None:
                    continue
                self.initialize_state([param])
                state = self.state[param]
                state["step"] += 1
                ids, grad = gradients.coalesce()
                if ids.numel():
                    with UPDATE.threads_for(grad.numel(), param.device):
                        self._update(param, ids.to(param.device), grad.to(param.device), state, int(state["step"]),
                                     group)
        return None

    def _update(self, param, ids, grad, state: dict, step: int, group: dict) -> None:
        raise NotImplementedError

    def _move_rows(self, param, ids, numerator: torch.Tensor, denominator: torch.Tensor, step_size: float,
                   group: dict, step: int) -> None:
        """The touched rows' update every rule ends with: ``w_r (1 - lr wd) - step_size numerator / denominator``
        (decoupled weight decay, on these rows only), written back in the table's dtype."""
        rows = param.index_select(0, ids).float()
        if group["weight_decay"]:
            rows.mul_(1.0 - group["lr"] * group["weight_decay"])
        rows.addcdiv_(numerator, denominator, value=-step_size)
        self._write(param, ids, rows, param, 0, step)

    def _write(self, tensor: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, param, which: int,
               step: int) -> None:
        """``tensor[ids] = values`` (fp32), stochastically rounded where ``tensor`` is bf16 (`TableAdamW`'s keys:
        ``which`` 0 for the rows, 1 and 2 for the moments)."""
        if tensor.dtype == torch.bfloat16:
            if values.dim() != 2:
                raise TypeError("only [rows, width] tensors are stored in bf16; row-wise state is kept in fp32")
            layout = self.layouts[param]
            key1, key2 = rounding_keys((self.seed, layout.table, step, which))
            element_ids = (self.global_rows(param)[ids].unsqueeze(1) * layout.global_width + layout.column_offset
                           + torch.arange(values.shape[1], device=values.device))
            values = reference.stochastic_round_to_bf16(values, reference.counter_noise(key1, key2, element_ids))
        tensor.index_copy_(0, ids, values.to(tensor.dtype))


class RowwiseAdagrad(SparseTableOptimizer):
    """FBGEMM's exact row-wise AdaGrad on the touched rows (the module docstring)."""

    state_entries = (StateEntry("momentum", per_row=True),)

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-8, weight_decay: float = 0.0,
                 row_group: Optional[dist.ProcessGroup] = None, seed: int = 0):
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay), "fp32", seed, row_group)

    @classmethod
    def for_tables(cls, groups, *, lr, betas, eps, weight_decay, state_dtype, seed, row_group=None):
        return cls(groups, lr=lr, eps=eps, weight_decay=weight_decay, row_group=row_group, seed=seed)  # no moments

    def _update(self, param, ids, grad, state, step, group):
        momentum = state["momentum"]
        if param.dtype == torch.float32 and self.whole_rows:
            # a whole row on this rank: one pass over each touched row (the kernels' dispatch)
            ops.rowwise_adagrad_rows_(param, momentum, ids, grad, self.layouts[param].global_width, group["lr"],
                                      group["eps"], group["weight_decay"])
            return
        accumulated = momentum.index_select(0, ids) + self.row_mean_square(param, grad)
        momentum.index_copy_(0, ids, accumulated)
        self._move_rows(param, ids, grad, (accumulated.sqrt() + group["eps"]).unsqueeze(1), group["lr"], group, step)


class SparseAdamRule(SparseTableOptimizer):
    """What the sparse Adam rules share: their settings and the first moment, per parameter in
    ``state_dtype``, updated and written back for the touched rows."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 state_dtype: str = "fp32", seed: int = 0, row_group: Optional[dist.ProcessGroup] = None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), state_dtype,
                         seed, row_group)

    def _first_moment(self, param, ids, grad, state: dict, step: int, beta1: float) -> torch.Tensor:
        """``m = b1 m + (1 - b1) g`` of the touched rows (fp32), stored back."""
        exp_avg = state["exp_avg"].index_select(0, ids).float().mul_(beta1).add_(grad, alpha=1 - beta1)
        self._write(state["exp_avg"], ids, exp_avg, param, 1, step)
        return exp_avg


class LazyAdam(SparseAdamRule):
    """Adam on the touched rows, `torch.optim.SparseAdam`'s formula (the module docstring)."""

    state_entries = (StateEntry("exp_avg"), StateEntry("exp_avg_sq"))

    def _update(self, param, ids, grad, state, step, group):
        beta1, beta2 = group["betas"]
        exp_avg = self._first_moment(param, ids, grad, state, step, beta1)
        exp_avg_sq = state["exp_avg_sq"].index_select(0, ids).float().mul_(beta2).addcmul_(grad, grad,
                                                                                           value=1 - beta2)
        self._write(state["exp_avg_sq"], ids, exp_avg_sq, param, 2, step)
        step_size = group["lr"] * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        self._move_rows(param, ids, exp_avg, exp_avg_sq.sqrt_().add_(group["eps"]), step_size, group, step)


class PartialRowwiseAdam(SparseAdamRule):
    """FBGEMM's partial row-wise Adam on the touched rows (the module docstring): the first moment per
    element in ``state_dtype``, the second per row in fp32."""

    state_entries = (StateEntry("exp_avg"), StateEntry("exp_avg_sq", per_row=True))

    def _update(self, param, ids, grad, state, step, group):
        beta1, beta2 = group["betas"]
        exp_avg = self._first_moment(param, ids, grad, state, step, beta1)
        exp_avg_sq = state["exp_avg_sq"].index_select(0, ids).mul_(beta2).add_(self.row_mean_square(param, grad),
                                                                              alpha=1 - beta2)
        state["exp_avg_sq"].index_copy_(0, ids, exp_avg_sq)
        denominator = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(group["eps"]).unsqueeze(1)
        self._move_rows(param, ids, exp_avg, denominator, group["lr"] / (1 - beta1 ** step), group, step)
