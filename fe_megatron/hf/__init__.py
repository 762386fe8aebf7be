"""The Hugging Face side of fe_megatron: a transformers model, tokenizer export and registration.

``import fe_megatron.hf`` registers the model with transformers' Auto classes, so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads a converted directory without
``trust_remote_code`` (the directory also carries the modeling files for loading with it).
"""

from __future__ import annotations

import os
import shutil

from fe_megatron.hf.configuration_fe_megatron import FactorEngramConfig
from fe_megatron.hf.modeling_fe_megatron import (FactorEngramCache, FactorEngramForCausalLM, FactorEngramModel,
                                                 FactorEngramPreTrainedModel)

MODELING_FILES = ("configuration_fe_megatron.py", "modeling_fe_megatron.py")
AUTO_MAP = {"AutoConfig": "configuration_fe_megatron.FactorEngramConfig",
            "AutoModel": "modeling_fe_megatron.FactorEngramModel",
            "AutoModelForCausalLM": "modeling_fe_megatron.FactorEngramForCausalLM"}


def register() -> None:
    """Register `FactorEngramConfig` and the models with transformers' Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    try:
        AutoConfig.register(FactorEngramConfig.model_type, FactorEngramConfig)
        AutoModel.register(FactorEngramConfig, FactorEngramModel)
        AutoModelForCausalLM.register(FactorEngramConfig, FactorEngramForCausalLM)
    except ValueError:  # already registered
        pass


def write_modeling_files(directory: str) -> None:
    """Copy the modeling files into ``directory`` for ``trust_remote_code=True`` loading (they import
    the installed fe_megatron for the memory branch)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for name in MODELING_FILES:
        shutil.copyfile(os.path.join(here, name), os.path.join(directory, name))


def save_tokenizer(sentencepiece_model: str, directory: str, model_max_length: int = None):
    """Save the run's sentencepiece model as a Hugging Face tokenizer (``tokenizer.json`` and its
    config, with the model itself as ``tokenizer.model``) in ``directory``: the same pieces and ids,
    and sentencepiece's ids for every text (`fe_megatron.hf.tokenizer`).  Returns it."""
    from fe_megatron.hf.tokenizer import save_tokenizer as save

    return save(sentencepiece_model, directory, model_max_length)


register()

__all__ = ["AUTO_MAP", "FactorEngramCache", "FactorEngramConfig", "FactorEngramForCausalLM", "FactorEngramModel",
           "FactorEngramPreTrainedModel", "register", "save_tokenizer", "write_modeling_files"]
