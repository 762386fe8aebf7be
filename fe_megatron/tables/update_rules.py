"""The table update rules (``optimizer.table_update``): one entry each, the one place a rule is named.

An entry names the rule's optimizer class and whether it updates only the touched rows (``sparse``:
its gradient is kept by row, `fe_megatron.tables.store.RowGradients`, and no dense accumulator
exists).  Everything else is read from the class's `StateEntry` list, so every reader follows a new
rule without an edit:

* bytes: `UpdateRule.state_bytes_per_parameter` (`TablePlan`, ``fe-plan``'s rank memory);
* sharding: per-parameter state is sharded as the table is (rows, tensor-parallel columns); per-row
  state by rows, the tensor-parallel ranks of a row holding replicas of one value (the squares are
  summed over the whole row);
* checkpoint keys: `UpdateRule.checkpoint_key` (Megatron's dist-checkpoint names, by global row, which
  both engines write);
* which checkpoints carry over: `UpdateRule.state_layout` (the resume guard refuses a change of rule
  that changes it).

Adding a rule: its class in `fe_megatron.tables.sparse_update` (or beside `TableAdamW`) and one line in
`RULES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from fe_megatron.tables.optimizer import TableAdamW
from fe_megatron.tables.sparse_update import LazyAdam, PartialRowwiseAdam, RowwiseAdagrad


@dataclass(frozen=True)
class UpdateRule:
    """One ``optimizer.table_update`` rule (see the module docstring)."""

    name: str
    optimizer: type  # a fe_megatron.tables.optimizer.TableOptimizerBase
    sparse: bool  # only the touched rows, from row gradients
    state_words: str  # its state, for fe-plan ({state_dtype}: optimizer.table_state_dtype)

    @property
    def state(self) -> tuple:
        return self.optimizer.state_entries

    @property
    def state_layout(self) -> tuple:
        """``((key, per_row), ...)``: two rules with the same layout load each other's checkpoints."""
        return tuple((entry.key, entry.per_row) for entry in self.state)

    @property
    def row_state_keys(self) -> tuple:
        """The keys of the state kept one value per row."""
        return tuple(entry.key for entry in self.state if entry.per_row)

    @staticmethod
    def checkpoint_key(key: str, per_row: bool) -> str:
        """The name of state ``key`` in a Megatron checkpoint (``optimizer.state.<name>.<table>``): per-row
        state as ``row_<key>``, a [global rows, 1] tensor."""
        return f"row_{key}" if per_row else key

    def state_bytes_per_parameter(self, width: int, state_dtype: str) -> float:
        """Optimizer state bytes per table parameter (rows of ``width`` columns on a rank)."""
        return sum(entry.bytes_per_parameter(width, state_dtype) for entry in self.state)

    def describe_state(self, state_dtype: str) -> str:
        """What a rank keeps beside the rows, for ``fe-plan``."""
        words = self.state_words.format(state_dtype=state_dtype)
        return f"gradients of the touched rows only, {words}" if self.sparse else f"{state_dtype} gradients and {words}"

    def build(self, tables: list, optimizer_args, state_dtype: str, seed: int,
              row_group: Optional[dist.ProcessGroup] = None):
        """The rule's optimizer over ``tables`` (`fe_megatron.tables.store.TableStore`s), with the run's
        optimizer section (``lr``, betas, eps, weight decay and the tables' multipliers)."""
        o = optimizer_args
        group = {"params": tables, "lr_mult": o.table_lr_mult, "wd_mult": o.table_weight_decay_mult}
        return self.optimizer.for_tables([group], lr=o.lr * o.table_lr_mult, betas=(o.beta1, o.beta2), eps=o.eps,
                                         weight_decay=o.weight_decay * o.table_weight_decay_mult,
                                         state_dtype=state_dtype, seed=seed, row_group=row_group)


RULES = {rule.name: rule for rule in (
    UpdateRule("adamw", TableAdamW, sparse=False,
               state_words="Adam moments"),
    UpdateRule("rowwise_adagrad", RowwiseAdagrad, sparse=True,
               state_words="rowwise_adagrad's one fp32 state per row"),
    UpdateRule("lazy_adam", LazyAdam, sparse=True,
               state_words="{state_dtype} Adam moments (lazy_adam)"),
    UpdateRule("partial_rowwise_adam", PartialRowwiseAdam, sparse=True,
               state_words="{state_dtype} first moments and one fp32 second moment per row (partial_rowwise_adam)"),
)}
TABLE_UPDATES = tuple(RULES)


def update_rule(name: str) -> UpdateRule:
    """The entry of rule ``name``; a ValueError names the known rules."""
    if name not in RULES:
        raise ValueError(f"optimizer.table_update {name!r} is not one of {TABLE_UPDATES}")
    return RULES[name]
