"""The memory branch as plain PyTorch modules (no Megatron dependency).

`FactorEngram` and `Engram` are the only implementations of the branch.  Every parallel layout,
the Megatron layers included, runs them through `ParallelHooks` and the sharding plan
(`fe_megatron.memory.sharding.SHARDING_PLAN`).
"""

from typing import Optional

from fe_megatron.config import MemoryConfig
from fe_megatron.memory.branch import MemoryBranch
from fe_megatron.memory.decoding import Decoding, DecodingState
from fe_megatron.memory.engram import Engram
from fe_megatron.memory.factorengram import FactorEngram
from fe_megatron.memory.loss import layer_sparsity, sparsity_loss, weighted_sparsity
from fe_megatron.memory.parallel_hooks import ParallelHooks
from fe_megatron.memory.sharding import SHARDING_PLAN
from fe_megatron.memory.short_conv import ShortConv
from fe_megatron.memory.tables import NgramTables

BRANCH_CLASSES = {"factorengram": FactorEngram, "engram": Engram}


def build_memory(config: MemoryConfig, layer_index: int, parallel: Optional[ParallelHooks] = None,
                 initialize: bool = True) -> MemoryBranch:
    """The branch class that ``config.kind`` names: `FactorEngram` or `Engram`."""
    return BRANCH_CLASSES[config.kind](config, layer_index, parallel, initialize)


__all__ = ["BRANCH_CLASSES", "Decoding", "DecodingState", "Engram", "FactorEngram", "MemoryBranch", "NgramTables",
           "ParallelHooks", "SHARDING_PLAN", "ShortConv", "build_memory", "layer_sparsity", "sparsity_loss",
           "weighted_sparsity"]
