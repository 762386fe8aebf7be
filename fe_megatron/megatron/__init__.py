"""Megatron-Core adapter: layer specs, the GPT model, the CPU backend, and fe-pretrain's Megatron
engine (`fe_megatron.megatron.engine`, imported on use).

Transformer Engine is optional: importing this package never needs it.  Importing it changes nothing
global: what a run changes in megatron-core and torch (the CPU backend, Megatron's fused accumulation
of the tables' gradients into ``main_grad``) goes into the run's `fe_megatron.megatron.patches.PatchScope`
and is undone when the run ends.
"""

from fe_megatron.megatron.cpu_backend import enable_cpu_backend
from fe_megatron.megatron.gpt_model import FactorEngramGPTModel
from fe_megatron.megatron.layer_specs import get_gpt_layer_with_factorengram_spec
from fe_megatron.megatron.memory_layer import build_memory_branch
from fe_megatron.megatron.memory_parallel import MegatronParallelHooks
from fe_megatron.megatron.patches import PatchScope
from fe_megatron.megatron.transformer_layer import FactorEngramTransformerLayer

__all__ = ["FactorEngramGPTModel", "FactorEngramTransformerLayer",
           "MegatronParallelHooks", "PatchScope", "build_memory_branch", "enable_cpu_backend",
           "get_gpt_layer_with_factorengram_spec"]
