"""``fe-convert mcore-to-hf``: a Megatron-engine checkpoint of any TP/PP/DP layout and table
sharding becomes a `FactorEngramForCausalLM` directory: safetensors shards, the config, the
modeling files and the tokenizer.  Tensors are read one at a time from the checkpoint and
written straight to the shard files (`fe_megatron.hf.safetensors_stream`), so no table is ever
held twice.  `write_hf_directory` is shared with ``deepspeed-to-hf``."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Optional

import torch

from fe_megatron.checkpoint.files import read_run_info
from fe_megatron.checkpoint.reader import configs_of
from fe_megatron.config import BackboneConfig, MemoryConfig
from fe_megatron.convert.common import (TRAINING_SETTINGS, ConversionError, Progress, check_vocabulary,
                                        find_run_checkpoint, fresh_output, training_settings,
                                        publish, run_tokenizer)
from fe_megatron.convert.megatron_reader import open_checkpoint, split_checkpoint_tensor
from fe_megatron.tables.storage import ROW_SCALE, STORAGE, has_row_scale, quantize_table

TABLE_WEIGHT = "memory.tables.weight"  # the end of every table's name in a transformers directory


def _save_tokenizer(path: str, directory: str, vocab_size: int, max_length: int):
    """The tokenizer at ``path`` (sentencepiece file or HF directory) saved as an HF tokenizer in
    ``directory``; a sentencepiece model is also kept as ``tokenizer.model``."""
    from transformers import AutoTokenizer

    from fe_megatron.hf import save_tokenizer

    if os.path.isdir(path):
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.save_pretrained(directory)
    else:
        tokenizer = save_tokenizer(path, directory, max_length)
    check_vocabulary(len(tokenizer), vocab_size, path)
    return tokenizer


def mcore_to_hf(load: str, output: str, iteration: Optional[int] = None, tokenizer: Optional[str] = None,
                max_shard_bytes: int = 2 << 30, table_dtype: Optional[str] = None) -> str:
    """Convert an fe-pretrain checkpoint into a transformers directory ``output``; returns it."""
    folder = find_run_checkpoint(load, iteration, require_run_info=False)
    info = read_run_info(folder) or megatron_lm_run_info(folder)
    if info.get("not_convertible"):
        raise ConversionError(f"{folder}: {info['not_convertible']}")
    backbone, memory = configs_of(info)
    if backbone.num_experts:  # before its expert weights are read as unknown tensors
        raise ConversionError(f"{folder}: the backbone has {backbone.num_experts} experts per layer "
                              "(model.num_experts), and the Hugging Face model's FFN is dense: an MoE checkpoint has "
                              "no Hugging Face form (fe-pretrain reports its validation and test perplexity in the "
                              "run's metrics.jsonl)")
    tokenizer_path = run_tokenizer(info, tokenizer)
    checkpoint = open_checkpoint(folder)
    groups = []
    for name in checkpoint.weight_names():
        parts = split_checkpoint_tensor(name, torch.empty(checkpoint.shape(name), device="meta"), backbone)
        groups.append((name, [(hf_name, tuple(t.shape), checkpoint.dtype(name)) for hf_name, t in parts]))
    return write_hf_directory(output, backbone, memory, tokenizer_path, groups,
                              lambda name: split_checkpoint_tensor(name, checkpoint.load(name), backbone),
                              f"mcore-to-hf {folder}", max_shard_bytes, table_dtype, training_settings(info, folder))


def megatron_lm_run_info(folder: str) -> dict:
    """The run info of a Megatron-LM checkpoint written without one, from the arguments it stores
    (`fe_megatron.megatron_lm.run_info.run_info_from_checkpoint_arguments`; megatron-core 0.19 on)."""
    try:
        from fe_megatron.megatron_lm.run_info import run_info_from_checkpoint_arguments
    except ImportError:
        raise ConversionError(f"{folder} has no fe_run.json (the run's config), and reading a Megatron-LM "
                              "checkpoint's own arguments needs megatron-core 0.19 or newer (`make setup-newest`); "
                              "or resume the run with fe-pretrain --load, whose next save records it") from None
    try:
        return run_info_from_checkpoint_arguments(folder)
    except ValueError as error:
        raise ConversionError(str(error)) from None


def write_hf_directory(output: str, backbone: BackboneConfig, memory: Optional[MemoryConfig], tokenizer_path: str,
                       groups: list, produce, where: str, max_shard_bytes: int = 2 << 30,
                       table_dtype: Optional[str] = None, settings: Optional[dict] = None) -> str:
    """A transformers directory ``output`` (written to ``output.tmp``, renamed at the end): the
    config of ``backbone`` and ``memory``, the tokenizer, the modeling files, and the weights that
    ``produce(source)`` returns source by source as ``groups`` plans them
    (`fe_megatron.hf.safetensors_stream.write_shards`), with the tables stored as ``table_dtype``
    (`fe_megatron.tables.storage`; None: as trained, ``memory.table_dtype``).  The model holds
    its tables where it runs: the host tier is a training placement, so the config says ``device``.
    ``settings`` (`fe_megatron.convert.common.training_settings`), the training settings of the run
    the weights come from, go to ``fe_training.json`` for ``hf-to-mcore``."""
    from fe_megatron.hf import AUTO_MAP, FactorEngramConfig, write_modeling_files
    from fe_megatron.hf.safetensors_stream import write_shards

    if table_dtype is not None and memory is None:
        raise ConversionError(f"{where}: --table-dtype {table_dtype}: this model has no memory, so no tables "
                              "to store; leave --table-dtype out")
    if memory is not None:
        trained = memory.table_dtype
        memory = dataclasses.replace(memory, table_dtype=table_dtype or trained, table_placement="device")
        if memory.table_dtype != trained:
            groups, produce = _stored_tables(groups, produce, memory.table_dtype)
    tmp = fresh_output(output)
    try:
        hf_tokenizer = _save_tokenizer(tokenizer_path, tmp, backbone.vocab_size, backbone.seq_length)
        config = FactorEngramConfig.from_fe_megatron(
            backbone, memory, bos_token_id=hf_tokenizer.bos_token_id, eos_token_id=hf_tokenizer.eos_token_id,
            pad_token_id=hf_tokenizer.pad_token_id, architectures=["FactorEngramForCausalLM"], auto_map=AUTO_MAP)
        _check_same_weights(_hf_weight_shapes(config), {n: s for _, entries in groups for n, s, _ in entries}, where)
        progress = Progress(sum(weights_bytes(entries) for _, entries in groups), where)
        write_shards(tmp, groups, produce, max_shard_bytes=max_shard_bytes, progress=progress)
        progress.close()
        config.save_pretrained(tmp)
        if settings is not None:
            with open(os.path.join(tmp, TRAINING_SETTINGS), "w") as fh:
                json.dump(settings, fh, indent=1)
        write_modeling_files(tmp)
        _write_generation_config(config, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, output)


def _stored_tables(groups: list, produce, table_dtype: str) -> tuple:
    """``groups`` and ``produce`` with every table quantized to ``table_dtype`` as it is written
    (one table at a time), and an fp8 table's row scales beside it."""
    def planned(entries):
        out = []
        for name, shape, dtype in entries:
            if not name.endswith(TABLE_WEIGHT):
                out.append((name, shape, dtype))
                continue
            out.append((name, shape, STORAGE[table_dtype]))
            if has_row_scale(table_dtype):
                out.append((name[:-len("weight")] + ROW_SCALE, (shape[0],), torch.float32))
        return out

    def quantized(source):
        for name, tensor in produce(source):
            if not name.endswith(TABLE_WEIGHT):
                yield name, tensor
                continue
            try:
                stored = quantize_table(tensor, table_dtype)
            except ValueError as err:
                raise ConversionError(f"{name}: {err}") from None
            yield name, stored["weight"]
            if ROW_SCALE in stored:
                yield name[:-len("weight")] + ROW_SCALE, stored[ROW_SCALE]

    return [(source, planned(entries)) for source, entries in groups], quantized


def weights_bytes(entries) -> int:
    from fe_megatron.hf.safetensors_stream import tensor_bytes

    return sum(tensor_bytes(shape, dtype) for _, shape, dtype in entries)


def _hf_weight_shapes(config) -> dict:
    """``{name: shape}`` of the weights a `FactorEngramForCausalLM` of ``config`` saves (built on the
    meta device: nothing is allocated)."""
    from fe_megatron.hf import FactorEngramForCausalLM

    with torch.device("meta"):
        model = FactorEngramForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _check_same_weights(expected: dict, got: dict, where: str) -> None:
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = sorted(name for name in set(expected) & set(got) if tuple(expected[name]) != tuple(got[name]))
    if missing or extra or wrong:
        lines = [f"missing: {missing[:8]}" if missing else "", f"unexpected: {extra[:8]}" if extra else "",
                 "shapes differ: " + ", ".join(f"{n} {tuple(got[n])} vs {tuple(expected[n])}" for n in wrong[:8])
                 if wrong else ""]
        raise ConversionError(f"{where}: the weights do not match the model its config describes: "
                              + "; ".join(line for line in lines if line))


def _write_generation_config(config, directory: str) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(directory)

