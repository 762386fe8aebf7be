"""Megatron-Core adapter: layer specs, the GPT model, the CPU backend, and fe-pretrain's Megatron
engine (`fe_megatron.megatron.engine`, imported on use).

Transformer Engine is optional: importing this package never needs it.  Importing it registers
Megatron's fused accumulation of the tables' gradients into ``main_grad`` with the core's kernels
(`fe_megatron.megatron.main_grad`).
"""

from fe_megatron import ops
from fe_megatron.megatron.cpu_backend import enable_cpu_backend
from fe_megatron.megatron.gpt_model import FactorEngramGPTModel
from fe_megatron.megatron.layer_specs import get_gpt_layer_with_factorengram_spec
from fe_megatron.megatron.main_grad import accumulate_into_main_grad
from fe_megatron.megatron.memory_layer import build_memory_branch
from fe_megatron.megatron.memory_parallel import MegatronParallelHooks
from fe_megatron.megatron.transformer_layer import FactorEngramTransformerLayer

ops.register_weight_gradient_sink(accumulate_into_main_grad)

__all__ = ["FactorEngramGPTModel", "FactorEngramTransformerLayer",
           "MegatronParallelHooks", "build_memory_branch", "enable_cpu_backend",
           "get_gpt_layer_with_factorengram_spec"]
