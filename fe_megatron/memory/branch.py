"""What `FactorEngram` and `Engram` share: addressing and lookup (Eq. 1, 6), the causal
refinement (Eq. 10), input checks, and initialization from the sharding plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from fe_megatron.config import MemoryConfig
from fe_megatron.memory import functional as FM
from fe_megatron.memory.decoding import Decoding
from fe_megatron.memory.init import draw_seed, normal_by_global_rows_
from fe_megatron.memory.parallel_hooks import SINGLE_PROCESS, ParallelHooks
from fe_megatron.tables.row_exchange import RowPartition
from fe_megatron.memory.sharding import local_shape, param_sharding
from fe_megatron.memory.short_conv import ShortConv
from fe_megatron.tables.store import StartedLookup
from fe_megatron.memory.tables import NgramTables
from fe_megatron.ngram import NgramHasher


@dataclass(frozen=True)
class Normal:
    """Initialize from N(0, std^2) (layout-independent, `fe_megatron.memory.init`)."""

    std: float


class MemoryBranch(nn.Module):
    """Base of the memory branches.  ``kind`` names the branch in `MemoryConfig.kind` and in the
    sharding plan.

    ``parallel`` supplies the communication of a parallel layout (`ParallelHooks`; identity in
    a single process).  ``initialize=False`` leaves the parameters unset (they are about to be
    loaded from a checkpoint).
    """

    kind = ""

    def __init__(self, config: MemoryConfig, layer_index: int, parallel: Optional[ParallelHooks] = None,
                 initialize: bool = True):
        super().__init__()
        if config.kind != self.kind:
            raise ValueError(f"{type(self).__name__} needs MemoryConfig.kind={self.kind!r}, got {config.kind!r}; "
                             "use fe_megatron.memory.build_memory to pick the class from the config")
        self.config = config
        self.layer_index = layer_index
        self.parallel = parallel if parallel is not None else SINGLE_PROCESS
        self.hasher = NgramHasher(config, layer_index)
        tp = self.parallel.tensor_parallel_size
        if config.branch_width % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the branch width s_b={config.branch_width} "
                             f"(coeff_width={config.coeff_width} / {config.num_branches} branches); choose "
                             "coeff_width so that s_b % tp == 0")
        layout = self.hasher.layouts[0]
        self.row_partition = None  # tables whole on every rank of the memory-parallel group
        group = self.parallel.memory_parallel_group
        if group is not None:
            self.row_partition = RowPartition(layout.moduli, layout.offsets, dist.get_world_size(group),
                                              dist.get_rank(group))
        self.tables = NgramTables(*self.local_shape("tables.weight", (layout.total_rows, config.branch_width)),
                                  table_dtype=config.table_dtype)
        self.conv = ShortConv(config.output_size, config.conv_kernel_size, config.conv_dilation, config.norm_eps)

    # ----------------------------------------------------------------- parameters
    def local_shape(self, name: str, global_shape: tuple) -> tuple:
        """This rank's shape of parameter ``name``, per the sharding plan."""
        return local_shape(self.kind, name, global_shape, self.parallel.tensor_parallel_size, self.row_partition)

    def local_tensor(self, name: str) -> torch.Tensor:
        """This rank's values of parameter ``name`` (a parameter, or a table's rows wherever they live,
        a `TableStore`'s included)."""
        module, _, attribute = name.rpartition(".")
        return getattr(self.get_submodule(module), attribute)

    def initial_values(self) -> dict:
        """``{parameter name: Normal(std) or a constant}``, as documented in docs/method.md."""
        raise NotImplementedError

    def global_shape(self, name: str) -> tuple:
        """A parameter's shape in a single process (and in every checkpoint), from its local shape."""
        shape = list(self.local_tensor(name).shape)
        sharding = param_sharding(self.kind, name)
        if sharding.tensor_parallel_dim is not None:
            shape[sharding.tensor_parallel_dim] *= self.parallel.tensor_parallel_size
        if sharding.row_parallel and self.row_partition is not None:
            shape[0] = sum(self.row_partition.branch_rows)
        return tuple(shape)

    def global_row_slices(self, name: str) -> list:
        """``[(global_first_row, rows, local_first_row)]`` of a parameter: one slice, all of its rows,
        unless its rows are sharded."""
        if param_sharding(self.kind, name).row_parallel and self.row_partition is not None:
            return self.row_partition.slices()
        return [(0, self.local_tensor(name).shape[0], 0)]

    @torch.no_grad()
    def reset_parameters(self, seed: Optional[int] = None) -> None:
        """Initialize every parameter.  Random ones are drawn as slices of their global tensor from
        ``seed`` (one from torch's default generator when omitted), so a tensor-parallel rank holds
        exactly its slice of what a single process would hold."""
        seed = draw_seed() if seed is None else seed
        initial = self.initial_values()
        for name, param in self.named_parameters():
            if not name.startswith("tables."):
                self._draw(name, param, initial[name], seed)
        # in the tables' format, by their holder (fe_megatron.tables.holders); mapped tables are not drawn
        self.tables.initialize(lambda target: self._draw("tables.weight", target, initial["tables.weight"], seed))

    def _draw(self, name: str, target: torch.Tensor, value, seed: int) -> None:
        """Fill ``target`` (parameter ``name``'s local values) with a constant or its slices of a
        layout-independent normal draw."""
        if not isinstance(value, Normal):
            target.fill_(value)
            return
        for first, rows, local in self.global_row_slices(name):
            normal_by_global_rows_(target[local:local + rows], value.std, seed, name, self.global_shape(name),
                                   split_dim=param_sharding(self.kind, name).tensor_parallel_dim,
                                   split_rank=self.parallel.tensor_parallel_rank,
                                   split_size=self.parallel.tensor_parallel_size, row_offset=first)

    # ----------------------------------------------------------------- forward pieces
    def addresses(self, token_ids: torch.Tensor, decoding: Optional[Decoding] = None,
                  position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Eq. 1: the row indices of every position of ``token_ids`` ([batch, seq]), ``[.., branches]`` in
        this branch's sequence layout; with ``decoding`` (a single process, token by token), after the ids
        of earlier calls (its state is updated); with ``position_ids`` ([batch or 1, seq], reset to 0 where a
        packed document starts), no n-gram reaches before its document (`fe_megatron.ngram.hashing`)."""
        if decoding is not None:
            if self.parallel is not SINGLE_PROCESS:
                raise ValueError("decoding (padding masks, incremental state) needs a single-process branch: load "
                                 "the model in one process, or run it without a padding mask and without a cache")
            return decoding.indices(self, token_ids, position_ids)
        addresses = self.hasher.indices(token_ids, position_ids=position_ids)
        return addresses.transpose(0, 1) if self.parallel.sequence_dim == 0 else addresses

    def start_lookup(self, addresses: torch.Tensor, device=None) -> StartedLookup:
        """Start the lookup of ``addresses`` (Eq. 1's row indices, `addresses`) and return its handle, whose
        ``rows()`` are this rank's table rows of every position (the one lookup protocol, `fe_megatron.tables.store.
        StartedLookup`), from whatever holds the tables (`fe_megatron.tables.holders`): with row-sharded
        tables the row exchange (requests sent, rows on their way back), with tables in a `TableStore` the
        gather (and, from host memory, the copy to ``device``, by default the addresses' device), with tables
        the module holds a gather when read. When each starts: `fe_megatron.memory.inputs`."""
        if self.row_partition is not None and self.tables.exchange_group is None:
            raise RuntimeError(f"layer {self.layer_index}: its tables are row-sharded, and their rows are looked up "
                               "from their owners' stores: hand them to fe_megatron.tables.stage_tables.StageTables "
                               "first (or tables.manage(..., partition=branch.row_partition, "
                               "row_group=branch.parallel.memory_parallel_group))")
        return self.tables.start_lookup(addresses, addresses.device if device is None else torch.device(device))

    def lookup(self, hidden_states: torch.Tensor, token_ids: Optional[torch.Tensor],
               lookup: Optional[StartedLookup], decoding: Optional[Decoding] = None) -> torch.Tensor:
        """Eq. 1 and 6: the concatenated table rows of every position (this rank's columns under
        tensor parallelism), in the hidden states' dtype, from a started ``lookup`` or, with
        ``token_ids``, from one started now (``decoding``: after earlier calls' ids)."""
        if lookup is not None and not isinstance(lookup, StartedLookup):
            raise TypeError(f"lookup must be a started lookup (branch.start_lookup(addresses)), got a "
                            f"{type(lookup).__name__}")
        self._check_inputs(hidden_states, token_ids, None if lookup is None else lookup.indices)  # its addresses
        if lookup is None:
            lookup = self.start_lookup(self.addresses(token_ids, decoding), hidden_states.device)
        return self.tables(lookup).to(hidden_states.dtype)  # read through the module's call (its hooks)

    @staticmethod
    def sparsity_term(coefficients: torch.Tensor, decoding: Optional[Decoding] = None) -> Optional[torch.Tensor]:
        """Eq. 12's inner term ``||z_t||_1`` per position; None where the call has no loss to add it to (a server's
        step, `fe_megatron.memory.look_back.ServedStep`)."""
        if decoding is not None and not decoding.has_loss:
            return None
        return FM.l1_per_position(coefficients)

    def refine(self, values: torch.Tensor, decoding: Optional[Decoding] = None) -> torch.Tensor:
        """Eq. 10: ``m_t = v_t + SiLU(Conv1D(RMSNorm(v_{<=t})))_t``; with ``decoding`` (``generate``'s `Decoding`, or a
        server's `fe_megatron.memory.look_back.ServedStep`), after the values of earlier steps."""
        if decoding is not None:
            return decoding.refine(self.conv, values)
        return values + self.parallel.short_conv(self.conv, values)

    def _check_inputs(self, hidden_states, token_ids, indices) -> None:
        config, seq_dim = self.config, self.parallel.sequence_dim
        layout = "[seq, batch, hidden_size" if seq_dim == 0 else "[batch, seq, hidden_size"
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != config.hidden_size:
            raise ValueError(f"hidden_states must have shape {layout}={config.hidden_size}], "
                             f"got {tuple(hidden_states.shape)}")
        if not hidden_states.is_floating_point():
            raise TypeError(f"hidden_states must be a floating-point tensor, got dtype {hidden_states.dtype}")
        if (token_ids is None) == (indices is None):
            raise ValueError("pass exactly one of token_ids ([batch, seq] ids) or lookup (a started lookup: "
                             "branch.start_lookup(branch.addresses(token_ids)))")
        batch = hidden_states.shape[1 - seq_dim]
        expected = (batch, self.parallel.index_sequence_length(hidden_states.shape[seq_dim]))
        if token_ids is not None:
            got = tuple(token_ids.shape[:2]) if isinstance(token_ids, torch.Tensor) else None
        else:
            got = (indices.shape[1 - seq_dim], indices.shape[seq_dim]) if indices.dim() == 3 else None
            if indices.dim() == 3 and indices.shape[-1] != config.num_branches:
                raise ValueError(f"indices have {indices.shape[-1]} branches in their last axis; this layer has "
                                 f"{config.num_branches}")
        if got is not None and got != expected:
            raise ValueError(f"token ids / indices of shape {tuple((token_ids if indices is None else indices).shape)} "
                             f"do not match hidden_states [batch, seq] = {expected}")


def memory_branches(model: nn.Module) -> dict:
    """``{module name: branch}`` of every memory branch in ``model``."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MemoryBranch)}


def start_stage_lookups(branches: dict, indices: dict, device=None) -> dict:
    """Deprecated: `fe_megatron.memory.inputs.start_lookups`. Kept because the model file that
    ``fe-convert`` wrote next to converted weights before 2026-11-28 imports it (``trust_remote_code``)."""
    import warnings

    from fe_megatron.memory.inputs import start_lookups

    warnings.warn("fe_megatron.memory.branch.start_stage_lookups is deprecated; use "
                  "fe_megatron.memory.inputs.start_lookups", DeprecationWarning, stacklevel=2)
    return start_lookups(branches, indices, device)
