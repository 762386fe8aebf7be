"""`FactorEngramForCausalLM`: the transformers model of an fe_megatron checkpoint.

Transformers' Llama (attention, RoPE, RMSNorm, SwiGLU, KV cache, generation) with the memory
branch of `fe_megatron.memory` (the one implementation, not a copy) on the layers that
``config.memory["layers"]`` names, at its placement:

* ``before_attn``: ``h <- h + m(h)`` on the layer input (Eq. 11);
* ``before_ffn``:  ``h <- h + m(h)`` on the post-attention residual;
* ``inside_ffn``:  ``down(silu(gate x) * (up x + m(h)))`` with ``x`` the normed post-attention
  residual ``h``.

The branch reads the residual stream before any norm, as in the Megatron layers
(`fe_megatron.megatron.transformer_layer`), so both compute the same function.

Cached generation: `FactorEngramCache` is transformers' `DynamicCache` plus each branch's
`fe_megatron.memory.DecodingState` (the last ``max_order - 1`` ids and ``(K-1) r`` values), so a
decoding step costs the same whatever the context length.  Left padding is handled as in
`fe_megatron.memory.decoding`: padded positions count as lying before the sequence start.

With ``labels`` the loss is Eq. 13: the LM loss plus ``lambda`` times the L1 penalty averaged
over insertion layers (Eq. 12).

This file is also written next to converted weights, for ``trust_remote_code=True`` loading.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from transformers import DynamicCache, GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaPreTrainedModel, LlamaRMSNorm,
                                                      LlamaRotaryEmbedding)

from fe_megatron.memory import Decoding, DecodingState, MemoryBranch, build_memory, layer_sparsity, weighted_sparsity
from fe_megatron.memory.inputs import (MemoryInputs, given_inputs, refuse_renamed_keywords, schedule_lookups,
                                      start_lookups)

from .configuration_fe_megatron import FactorEngramConfig

logger = logging.get_logger(__name__)

# transformers 5.24 renamed the cache keyword of forwards, outputs and generate()'s model inputs
# from ``past_key_values`` to ``cache``.  These classes accept either and speak the installed one.
CACHE_KEYWORD = "cache" if "cache" in inspect.signature(LlamaDecoderLayer.forward).parameters else "past_key_values"


def _one_cache(cache, past_key_values):
    """The cache passed under either name (see ``CACHE_KEYWORD``)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the cache once, as `cache` or as `past_key_values`, not two different caches")
    return cache if cache is not None else past_key_values


class FactorEngramCache(DynamicCache):
    """Transformers' `DynamicCache` plus ``memory_states``: ``{layer_index: DecodingState}``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.memory_states: dict = {}

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self.memory_states = {layer: state.select(beam_idx) for layer, state in self.memory_states.items()}

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self.memory_states = {layer: state.select(indices) for layer, state in self.memory_states.items()}

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self.memory_states = {layer: state.repeat_interleave(repeats) for layer, state in self.memory_states.items()}

    def crop(self, max_length: int):
        if self.memory_states:
            raise NotImplementedError("FactorEngramCache cannot be cropped: the memory branches keep only the last "
                                      "few token ids and values, not the whole history (assisted or speculative "
                                      "decoding needs a crop); generate without an assistant model")
        super().crop(max_length)


@dataclass
class FactorEngramModelOutput(BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` plus ``sparsity_loss``: Eq. 12 averaged over insertion layers."""

    sparsity_loss: Optional[torch.FloatTensor] = None


@dataclass
class FactorEngramCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus ``sparsity_loss`` (Eq. 12, averaged over insertion layers,
    before lambda), so that a trainer can weigh and log it itself."""

    sparsity_loss: Optional[torch.FloatTensor] = None


class FactorEngramDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with a memory branch (``self.memory``) at ``memory_config.placement``."""

    def __init__(self, config: FactorEngramConfig, layer_idx: int, memory_config, memory_parallel=None):
        super().__init__(config, layer_idx)
        self.layer_index = layer_idx
        # Initialized by FactorEngramPreTrainedModel._init_weights, unless loaded from a checkpoint.
        self.memory = build_memory(memory_config, layer_idx, parallel=memory_parallel, initialize=False)
        for module in self.memory.modules():
            module._fe_memory_part = True

    def _memory(self, hidden_states, memory_inputs: MemoryInputs):
        """``(output, sparsity term)``: the branch's output on this forward's inputs (its lookup, and token by
        token its `Decoding`), and the layer's term of Eq. 12."""
        decoding = memory_inputs.decoding_of(self.layer_index)
        lookup = memory_inputs.lookup_of(self.layer_index, self.memory, hidden_states.device)
        memory_out, l1 = self.memory(hidden_states, lookup=lookup, decoding=decoding)
        if decoding is not None and decoding.valid is not None:
            l1 = l1[decoding.valid]  # padding is not text
        return memory_out, layer_sparsity(l1, len(self.memory.config.layers))  # Eq. 12

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, *, cache=None, memory_inputs: Optional[MemoryInputs] = None, **kwargs):
        """Llama's layer with the memory branch at its placement: ``(hidden states, the layer's sparsity term
        (Eq. 12))``. ``memory_inputs`` is this forward's `fe_megatron.memory.inputs.MemoryInputs`, built by
        `FactorEngramModel.forward`. The term is an output, not a side effect, so that gradient checkpointing
        of either kind (``use_reentrant`` True or False) gives it its gradient: a reentrant checkpoint runs the
        first pass without autograd and passes gradients only through what the layer returns."""
        if memory_inputs is None:
            raise ValueError("FactorEngramDecoderLayer reads its memory's inputs from memory_inputs, which "
                             "FactorEngramModel.forward builds; run the layer inside the model")
        cache = _one_cache(cache, past_key_values)
        placement = self.memory.config.placement
        if placement == "before_attn":
            memory_out, sparsity = self._memory(hidden_states, memory_inputs)
            hidden_states = hidden_states + memory_out
        residual = hidden_states
        attention_out, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                          attention_mask=attention_mask, position_ids=position_ids,
                                          use_cache=use_cache, position_embeddings=position_embeddings,
                                          **{CACHE_KEYWORD: cache}, **kwargs)
        hidden_states = residual + attention_out
        if placement == "before_ffn":
            memory_out, sparsity = self._memory(hidden_states, memory_inputs)
            hidden_states = hidden_states + memory_out
        residual = hidden_states
        normed = self.post_attention_layernorm(hidden_states)
        if placement == "inside_ffn":
            up_addend, sparsity = self._memory(hidden_states, memory_inputs)
            mlp = self.mlp
            return residual + mlp.down_proj(mlp.act_fn(mlp.gate_proj(normed)) * (mlp.up_proj(normed) + up_addend)), \
                sparsity
        return residual + self.mlp(normed), sparsity


class FactorEngramPreTrainedModel(LlamaPreTrainedModel):
    config_class = FactorEngramConfig
    config: FactorEngramConfig
    _no_split_modules = ["LlamaDecoderLayer", "FactorEngramDecoderLayer"]
    _can_compile_fullgraph = False  # token-id range checks synchronize with the host
    # with table_storage="mmap" the tables are mapped after loading, not loaded
    _keys_to_ignore_on_load_unexpected = [r"memory\.tables\.weight$"]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained``; with ``table_storage="mmap"`` (a keyword here, or the
        config's field) every table stays in its safetensors file and is read row by row through a
        memory mapping (`fe_megatron.hf.mmap_tables`).  Generation is the same token for token."""
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        if model.config.table_storage == "mmap":
            from fe_megatron.hf.mmap_tables import map_tables

            map_tables(model.base_model, str(pretrained_model_name_or_path))
        return model

    def save_pretrained(self, *args, **kwargs):
        if self.config.table_storage == "mmap":
            raise ValueError("this model's tables are mapped from the directory it was loaded from, not held in "
                             "it, so it cannot be saved; load it with table_storage='memory' to save it")
        return super().save_pretrained(*args, **kwargs)

    def _initialize_weights(self, module, *args, **kwargs):
        """transformers skips a module of code outside its package that has no direct parameters
        (Engram's branch has none: its tables, projections and convolution are submodules), so a
        memory branch is sent to `_init_weights` here."""
        if isinstance(module, MemoryBranch) and not getattr(module, "_is_hf_initialized", False):
            self._init_weights(module)
            module._is_hf_initialized = True
            return
        super()._initialize_weights(module, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        """A memory branch initializes itself (docs/method.md), unless it was loaded whole."""
        if isinstance(module, MemoryBranch):
            if not all(getattr(param, "_is_hf_initialized", False) for param in module.parameters()):
                module.reset_parameters()
            return
        if getattr(module, "_fe_memory_part", False):
            return
        super()._init_weights(module)


class FactorEngramModel(FactorEngramPreTrainedModel):
    """`LlamaModel` with memory branches; its forward feeds them the token ids.

    ``memory_parallel`` (`fe_megatron.memory.ParallelHooks`) builds the branches for a parallel
    layout, e.g. tables row-sharded over a process group (`fe_megatron.deepspeed`); by default
    every branch is whole, for one process."""

    def __init__(self, config: FactorEngramConfig, memory_parallel=None):
        super().__init__(config)
        memory = config.memory_config()
        if memory is not None:
            beyond = [layer for layer in memory.layers if layer >= config.num_hidden_layers]
            if beyond:
                raise ValueError(f"memory layers {beyond} do not exist: the model has {config.num_hidden_layers} "
                                 f"layers (0-based indices 0..{config.num_hidden_layers - 1})")
            if memory.placement == "inside_ffn" and config.hidden_act != "silu":
                raise ValueError(f"placement 'inside_ffn' needs a SwiGLU MLP (hidden_act='silu'), got "
                                 f"{config.hidden_act!r}")
        if config.table_storage not in ("memory", "mmap"):
            raise ValueError(f"table_storage={config.table_storage!r} is not one of 'memory', 'mmap'")
        memory_layers = set(memory.layers) if memory is not None else set()
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([
            FactorEngramDecoderLayer(config, index, memory, memory_parallel) if index in memory_layers
            else LlamaDecoderLayer(config, index) for index in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.memory_layers = sorted(memory_layers)
        if config.table_storage == "mmap":  # from_pretrained maps them (fe_megatron.hf.mmap_tables)
            for index in self.memory_layers:
                self.layers[index].memory.tables.release_for_mapping()
        self.post_init()

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values=None,
                inputs_embeds: Optional[torch.Tensor] = None, use_cache: Optional[bool] = None, cache=None,
                memory_inputs: Optional[MemoryInputs] = None, **kwargs):
        """``memory_inputs``: the lookups `start_memory_lookups` started ahead for these ``input_ids`` (the host
        tier's prefetch; training only), or addresses hashed by the caller (`fe_megatron.memory.inputs`); neither
        with padding or a cache, whose positions the model hashes itself."""
        refuse_renamed_keywords(kwargs)
        cache = _one_cache(cache, past_key_values)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        recomputed = self._memory_recomputed()
        if recomputed and (use_cache or cache is not None):
            # as transformers' layers do; the memory's decoding state would also advance in each run of a layer
            logger.warning_once("a cache cannot be used with gradient checkpointing (each layer runs twice); "
                                "training without one (use_cache=False)")
            use_cache, cache = False, None
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if self.memory_layers and input_ids is None:
            raise ValueError("the memory branches address their tables by token id: pass input_ids, not "
                             "inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = FactorEngramCache(config=self.config)
        given_positions = position_ids  # the memory reads only the caller's: the default counts up (no document)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        causal_mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds,
                                         attention_mask=attention_mask, position_ids=position_ids,
                                         **{CACHE_KEYWORD: cache})
        memory_inputs = self._memory_inputs(input_ids, attention_mask, cache, memory_inputs, recomputed,
                                            given_positions) if self.memory_layers else None
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        sparsity_terms: list = []
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            layer_kwargs = dict(attention_mask=causal_mask, position_embeddings=position_embeddings,
                                position_ids=position_ids, use_cache=use_cache, **{CACHE_KEYWORD: cache}, **kwargs)
            if isinstance(decoder_layer, FactorEngramDecoderLayer):
                hidden_states, sparsity = decoder_layer(hidden_states, memory_inputs=memory_inputs, **layer_kwargs)
                sparsity_terms.append(sparsity)
            else:
                hidden_states = decoder_layer(hidden_states, **layer_kwargs)
        hidden_states = self.norm(hidden_states)
        sparsity = torch.stack(sparsity_terms).sum() if sparsity_terms else None
        return FactorEngramModelOutput(last_hidden_state=hidden_states, sparsity_loss=sparsity,
                                       **{CACHE_KEYWORD: cache if use_cache else None})

    def start_memory_lookups(self, input_ids: torch.Tensor, device, position_ids=None) -> MemoryInputs:
        """The `MemoryInputs` of every memory layer for ``input_ids`` ([b, s]; within the documents of
        ``position_ids``) with every lookup started now, hashed where the ids are (the host tier hashes on the
        host) with the rows bound for ``device``; pass the result to ``forward`` as ``memory_inputs``."""
        branches = self._memory_branches()
        return MemoryInputs(lookups=start_lookups(branches, {
            index: branch.addresses(input_ids, position_ids=position_ids) for index, branch in branches.items()},
            device))

    def _memory_branches(self) -> dict:
        return {index: self.layers[index].memory for index in self.memory_layers}

    def _memory_recomputed(self) -> bool:
        """Whether transformers' gradient checkpointing runs the memory layers twice in this forward."""
        return self.training and torch.is_grad_enabled() and any(
            getattr(self.layers[index], "gradient_checkpointing", False) for index in self.memory_layers)

    def _memory_inputs(self, input_ids, attention_mask, cache, given: Optional[MemoryInputs],
                       recomputed: bool, position_ids: Optional[torch.Tensor]) -> MemoryInputs:
        """This forward's `MemoryInputs` (`fe_megatron.memory.inputs`): every memory layer's addresses, hashed
        here once (token by token, after the cache's ids; within the documents of ``position_ids``, which
        reset to 0 where each packed document starts, as transformers' packed batches give them). Row-sharded
        tables start every layer's lookup now, in one exchange; otherwise, and under gradient checkpointing
        (``recomputed``), each layer starts its own when it runs, on its own device. What ``given`` holds
        (lookups started ahead) is kept."""
        decodings = self._decodings(input_ids, attention_mask, cache)
        given = given_inputs(given)
        if given.layers and decodings:
            raise ValueError("memory_inputs (lookups started ahead or addresses hashed by the caller, for training) "
                             "cannot be used with padding or a cache, whose positions the model hashes itself; pass "
                             "use_cache=False and no attention_mask, or no memory_inputs")
        if given.lookups and recomputed:
            raise ValueError("lookups started ahead (memory_inputs) are read once, and gradient checkpointing runs "
                             "each layer twice; pass no memory_inputs while gradient checkpointing is on")
        branches = self._memory_branches()
        inputs = given.complete(branches, lambda index: branches[index].addresses(input_ids, decodings.get(index),
                                                                                   position_ids))
        row_sharded = any(branch.tables.exchange_group is not None for branch in branches.values())
        return schedule_lookups(branches, dataclasses.replace(inputs, decodings=decodings), recomputed=recomputed,
                                start_now=row_sharded)

    def _decodings(self, input_ids, attention_mask, cache) -> dict:
        """``{layer_index: Decoding}``: the padding of the new positions and, with a cache, each
        branch's state from earlier calls.  Empty when there is nothing to mask or carry."""
        if not self.memory_layers:
            return {}
        valid = None
        if attention_mask is not None and attention_mask.dim() == 2:
            new = attention_mask[:, attention_mask.shape[1] - input_ids.shape[1]:].bool()
            valid = None if bool(new.all()) else new
        if cache is None:
            return {} if valid is None else {layer: Decoding(valid) for layer in self.memory_layers}
        if not isinstance(cache, FactorEngramCache):
            raise TypeError(f"the cache is a {type(cache).__name__}; a model with memory branches keeps their "
                            f"decoding state in a FactorEngramCache (leave {CACHE_KEYWORD} unset, or pass "
                            "FactorEngramCache(config=model.config))")
        states = cache.memory_states
        if not states:
            if cache.get_seq_length() > 0:
                raise ValueError("this FactorEngramCache holds keys and values but no memory state; it was not "
                                 "filled by this model")
            for layer in self.memory_layers:
                branch = self.layers[layer].memory
                states[layer] = DecodingState.empty(branch, input_ids.shape[0], input_ids.device,
                                                    self.embed_tokens.weight.dtype)
        return {layer: Decoding(valid, states[layer]) for layer in self.memory_layers}


class FactorEngramForCausalLM(FactorEngramPreTrainedModel, GenerationMixin):
    """Causal LM over `FactorEngramModel`; ``loss`` (with ``labels``) is Eq. 13."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: FactorEngramConfig, memory_parallel=None):
        super().__init__(config)
        self.model = FactorEngramModel(config, memory_parallel)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, cache=None,
                memory_inputs: Optional[MemoryInputs] = None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=_one_cache(cache, past_key_values), inputs_embeds=inputs_embeds,
                             use_cache=use_cache, memory_inputs=memory_inputs, **kwargs)
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            memory = self.config.memory
            if outputs.sparsity_loss is not None and memory.get("sparsity_lambda", 0.0):
                loss = loss + weighted_sparsity(outputs.sparsity_loss, memory["sparsity_lambda"])  # Eq. 13
        return FactorEngramCausalLMOutput(loss=loss, logits=logits, sparsity_loss=outputs.sparsity_loss,
                                          **{CACHE_KEYWORD: getattr(outputs, CACHE_KEYWORD)})

    def start_memory_lookups(self, input_ids: torch.Tensor, device, position_ids=None) -> MemoryInputs:
        """`FactorEngramModel.start_memory_lookups`: pass the result to ``forward`` as ``memory_inputs``."""
        return self.model.start_memory_lookups(input_ids, device, position_ids)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate() makes a `DynamicCache`; make it a `FactorEngramCache` (the memory's state too)."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_KEYWORD)
        if type(cache) is DynamicCache and cache.get_seq_length() == 0:
            model_kwargs[CACHE_KEYWORD] = FactorEngramCache(config=self.config.get_text_config(decoder=True))
