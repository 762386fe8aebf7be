"""The memory branch as plain PyTorch modules (no Megatron dependency)."""

from fe_megatron.config import MemoryConfig
from fe_megatron.memory.engram import Engram
from fe_megatron.memory.factorengram import FactorEngram
from fe_megatron.memory.loss import sparsity_loss
from fe_megatron.memory.short_conv import ShortConv
from fe_megatron.memory.tables import CoefficientTables


def build_memory(config: MemoryConfig, layer_number: int):
    """`FactorEngram` for ``representation='factorized'``, `Engram` for ``'dense'``."""
    return (FactorEngram if config.representation == "factorized" else Engram)(config, layer_number)


__all__ = ["CoefficientTables", "Engram", "FactorEngram", "ShortConv", "build_memory", "sparsity_loss"]
