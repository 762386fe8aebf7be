"""fe_megatron: FactorEngram memory for Megatron-Core pretraining."""

from fe_megatron.config import MemoryConfig

__version__ = "0.1.0"
__all__ = ["MemoryConfig", "__version__"]
