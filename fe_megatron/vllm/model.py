"""`FactorEngramForCausalLM` for vLLM: the folder ``fe-convert mcore-to-hf`` writes, served.

The backbone is vLLM's Llama (`vllm.model_executor.models.llama`): its paged attention, its RoPE,
its fused linear layers and their tensor-parallel split.  The memory branches are
`fe_megatron.memory`'s (FactorEngram, the Engram baseline and every ablation preset the Hugging
Face model loads), each wrapped in a `ServedMemory` that keeps each request's look-back in vLLM's
state cache, and sit where the config places them, as in `fe_megatron.hf.modeling_fe_megatron`:

* ``before_attn``: ``h <- h + m(h)`` on the layer input (Eq. 11);
* ``before_ffn``:  ``h <- h + m(h)`` on the post-attention residual;
* ``inside_ffn``:  ``down(silu(gate x) * (up x + m(h)))``.

vLLM carries the residual stream as ``(hidden_states, residual)`` and adds them in its fused add+norm; the
memory reads the stream and its output joins it through the fused add+norm that follows.  The memory runs as
vLLM custom ops (`fe_megatron.vllm.memory_layer`), so vLLM compiles the model around them, and one router
hashes every memory layer's addresses once per step.

Under tensor parallelism every rank holds the whole memory branch and its tables (they read the
replicated residual stream); ``inside_ffn`` adds the rank's slice of ``m`` to its slice of the
up projection.  Tables are served in the checkpoint's format (``memory.table_dtype``: fp32, bf16,
fp8), or memory-mapped from the safetensors files with ``--hf-overrides '{"table_storage":
"mmap"}'`` (`fe_megatron.hf.mmap_tables`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import IsHybrid, SupportsMambaPrefixCaching
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

from fe_megatron.memory import build_memory
from fe_megatron.memory.look_back import state_shapes
from fe_megatron.vllm.memory_layer import (STATE_COPY_FUNCS, ServedMemory, ServedMemoryRouter, check_vllm_internals,
                                         state_dtypes)

TABLE_SUFFIX = ".memory.tables.weight"


class FactorEngramDecoderLayer(LlamaDecoderLayer):
    """vLLM's Llama layer, with the memory branch of ``layer_index`` (if the config names it) at its placement.

    vLLM carries the stream as ``(hidden_states, residual)`` and adds them in its fused add+norm; the memory's
    output joins the stream through the same fused add+norm of the norm that follows it."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, layer_index: int, memory_config):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.memory = None
        if memory_config is not None and layer_index in memory_config.layers:
            branch = build_memory(memory_config, layer_index, initialize=False)
            self.memory = ServedMemory(branch, vllm_config.model_config.dtype, prefix=f"{prefix}.memory")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                addresses: Optional[torch.Tensor] = None):
        if self.memory is None:
            return super().forward(positions, hidden_states, residual)
        placement = self.memory.branch.config.placement
        if placement == "before_attn":  # h + m(h), then the layer as vLLM runs it (Eq. 11)
            stream = hidden_states if residual is None else hidden_states + residual
            return super().forward(positions, self.memory(stream, addresses), stream)
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        attention = self.self_attn(positions=positions, hidden_states=hidden_states)
        if placement == "before_ffn":
            stream = attention + residual
            hidden_states, residual = self.post_attention_layernorm(self.memory(stream, addresses), stream)
            return self.mlp(hidden_states), residual
        hidden_states, residual = self.post_attention_layernorm(attention, residual)  # inside_ffn
        return self._mlp_with_addend(hidden_states, self.memory(residual, addresses)), residual

    def _mlp_with_addend(self, normed: torch.Tensor, addend: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate x) * (up x + addend))`` on this rank's slice of the intermediate width."""
        gate_up, _ = self.mlp.gate_up_proj(normed)
        gate, up = gate_up.chunk(2, dim=-1)
        width = up.shape[-1]
        first = get_tensor_model_parallel_rank() * width
        out, _ = self.mlp.down_proj(F.silu(gate) * (up + addend[..., first:first + width]))
        return out


@support_torch_compile(dynamic_arg_dims={"input_ids": {0: "b"}, "positions": {0: "b"},
                                         "intermediate_tensors": {0: "b"}, "inputs_embeds": {0: "b"}})
class FactorEngramModel(nn.Module):
    """Embedding, decoder layers (with memory where the config says) and the final norm; vLLM compiles its forward,
    the memory's custom ops left whole (`fe_megatron.vllm.memory_layer`)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        memory_config = config.memory_config()
        self.layers = nn.ModuleList([
            FactorEngramDecoderLayer(vllm_config, f"{prefix}.layers.{index}", index, memory_config)
            for index in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.memory_layers = [index for index, layer in enumerate(self.layers) if layer.memory is not None]
        self.router = None
        if self.memory_layers:  # one hash of every memory layer's addresses per step, one look-back of ids
            self.router = ServedMemoryRouter(memory_config, self.layers[self.memory_layers[0]].memory.prefix)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        addresses = None
        if self.router is not None:
            if input_ids is None:  # FactorEngramServingConfig refuses --enable-prompt-embeds
                raise ValueError("the memory branches address their tables by token id, and this forward has "
                                 "none: serve without --enable-prompt-embeds")
            addresses = self.router(input_ids)
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for index, layer in enumerate(self.layers):
            layer_addresses = None
            if layer.memory is not None:
                first, end = self.router.slices[index]
                layer_addresses = addresses[:, first:end]
            hidden_states, residual = layer(positions, hidden_states, residual, layer_addresses)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class FactorEngramForCausalLM(nn.Module, IsHybrid, SupportsMambaPrefixCaching):
    """The causal LM vLLM serves for ``architectures: ["FactorEngramForCausalLM"]``."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    # the Hugging Face names of the memory's parameters (layers.N.memory.*) onto ServedMemory's (memory.branch.*)
    hf_to_vllm_mapper = LlamaModel.hf_to_vllm_mapper | WeightsMapper(orig_to_new_substr={".memory.": ".memory.branch."})

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        memory_config = vllm_config.model_config.hf_config.memory_config()
        if memory_config is None:  # no memory layer holds a state; vLLM still sizes its pages from one
            return (1, 1), (1, 1)
        return state_shapes(memory_config, vllm_config.num_speculative_tokens)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return state_dtypes(vllm_config.model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        """How vLLM's align mode (prefix caching) copies a memory layer's look-back at a block boundary."""
        return STATE_COPY_FUNCS

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_vllm_internals()  # FactorEngramServingConfig checked the rest before the workers started
        self.config = config
        self.model = FactorEngramModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.mapped_tables = config.table_storage == "mmap"
        self.model_directory = vllm_config.model_config.model
        if self.mapped_tables:
            for index in self.model.memory_layers:
                self._tables(index).release_for_mapping()

    def _tables(self, index: int):
        return self.model.layers[index].memory.branch.tables

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def _weights_in_served_dtype(self, weights):
        """Each floating-point weight cast to its parameter's dtype as it loads (a float32 folder served in
        bfloat16, which FactorEngramServingConfig says once), instead of a warning for each from vLLM's loader.
        A weight vLLM stacks into a fused parameter (q, k, v; gate, up) has no parameter of its name and is
        left to that parameter's loader, which casts it."""
        dtypes = {name: param.dtype for name, param in self.named_parameters()}
        for name, tensor in weights:
            target = dtypes.get(self.hf_to_vllm_mapper.map_name(name))
            if target is not None and target.is_floating_point and tensor.is_floating_point() \
                    and tensor.dtype != target:
                tensor = tensor.to(target)
            yield name, tensor

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set:
        """Load the Hugging Face checkpoint; with ``table_storage="mmap"`` the tables are mapped from its files
        instead of loaded."""
        if not self.model.memory_layers:  # a plain Transformer, or served without its memory (hf_overrides memory=None)
            weights = ((name, tensor) for name, tensor in weights if ".memory." not in name)
        elif self.mapped_tables:
            weights = ((name, tensor) for name, tensor in weights if not name.endswith(TABLE_SUFFIX))
        if self.config.tie_word_embeddings:  # the head is the embedding
            weights = ((name, tensor) for name, tensor in weights if not name.startswith("lm_head."))
        loaded = AutoWeightsLoader(self).load_weights(self._weights_in_served_dtype(weights),
                                                      mapper=self.hf_to_vllm_mapper)
        if self.mapped_tables:
            from fe_megatron.hf.mmap_tables import map_layer_tables

            map_layer_tables({index: self._tables(index) for index in self.model.memory_layers},
                             self.model_directory)
            loaded |= {f"model.layers.{index}.memory.branch.tables.weight" for index in self.model.memory_layers}
        return loaded
