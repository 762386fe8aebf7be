"""``fe-convert hf-to-mcore``: a `FactorEngramForCausalLM` (or Llama) directory becomes a
weights-only fe-pretrain run directory.  It builds the Megatron model in this process, copies
the weights in (tables in row blocks, read from the memory-mapped safetensors) and saves a
weights-only checkpoint that ``fe-pretrain --load`` starts from at step 0 with a fresh
optimizer, at any layout; ``RUN_DIR/train.yaml`` holds the model, memory and ``--tp``/``--pp``
to train with.  `write_megatron_run` is shared with ``graft``."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Optional

import torch

from fe_megatron.config import BackboneConfig, MemoryConfig
from fe_megatron.convert.common import (TRAINING_SETTINGS, ConversionError, Progress, check_vocabulary, fresh_output,
                                        publish)
from fe_megatron.hf import weights
from fe_megatron.memory.sharding import MEGATRON_TABLE_SHARDINGS

ROW_BLOCK_BYTES = 64 << 20  # tables are copied in blocks of rows of about this size

def hf_to_mcore(input_dir: str, output: str, tp: int = 1, pp: int = 1, table_sharding: Optional[str] = None) -> str:
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
    if memory is not None and memory.table_dtype == "fp8":
        raise ConversionError(f"--input {input_dir} stores its tables as fp8, a serving format (fe-convert "
                              "--table-dtype) that training does not start from; convert the run's checkpoint to "
                              "Hugging Face with --table-dtype fp32 or bf16 and use that")
    source = SafetensorsSource(input_dir)
    tmp = fresh_output(output)
    try:
        if os.path.isfile(os.path.join(input_dir, "tokenizer.model")):
            tokenizer_path = os.path.join(tmp, "tokenizer.model")
            shutil.copyfile(os.path.join(input_dir, "tokenizer.model"), tokenizer_path)
            from fe_megatron.data.tokenizer import SentencePieceTokenizer

            check_vocabulary(SentencePieceTokenizer(tokenizer_path).vocab_size, backbone.vocab_size, tokenizer_path)
        else:
            tokenizer_path = os.path.join(tmp, "tokenizer")
            hf_tokenizer = AutoTokenizer.from_pretrained(input_dir)
            check_vocabulary(len(hf_tokenizer), backbone.vocab_size, input_dir)
            hf_tokenizer.save_pretrained(tokenizer_path)
        settings_file = os.path.join(input_dir, TRAINING_SETTINGS)
        settings = None
        if os.path.isfile(settings_file):
            with open(settings_file) as fh:
                settings = json.load(fh)
        write_megatron_run(source, backbone, memory, tokenizer_path, tmp, output, tp, pp, table_sharding, settings)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        source.close()
    return publish(tmp, output)


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
                       directory: str, final_directory: str, tp: int, pp: int, table_sharding: Optional[str],
                       settings: Optional[dict] = None) -> None:
    """Build the Megatron model in this process, copy ``source``'s weights (Hugging Face names) in,
    and save a weights-only checkpoint plus ``train.yaml`` into ``directory``.  The checkpoint's
    tensors are stored by global name, so it loads at any ``tp``/``pp``; ``train.yaml`` records them
    (`train_yaml` says what else it holds)."""
    from fe_megatron.megatron.parallel import initialize, shutdown

    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ConversionError("fe-convert runs in one process; start it without torchrun")
    started_here = not dist.is_initialized()
    launcher_env = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                         "MASTER_PORT")}
    initialize(1, 1, seed=0)
    try:
        _write_megatron_run(source, backbone, memory, tokenizer_path, directory, final_directory, tp, pp,
                            table_sharding, settings)
    finally:
        if started_here:
            shutdown()  # the model-parallel state and the group, joined before Python exits
            for key, value in launcher_env.items():  # initialize() filled these in for its single process
                if value is None:
                    os.environ.pop(key, None)
        else:
            shutdown(process_groups=False)  # the caller's group stays; Megatron's state and patches go


def _write_megatron_run(source, backbone, memory, tokenizer_path, directory, final_directory, tp, pp,
                        table_sharding, settings) -> None:
    from fe_megatron.megatron.builder import build_gpt_model
    from fe_megatron.megatron.checkpointing import save_checkpoint
    from fe_megatron.checkpoint.run_info import run_info
    from fe_megatron.megatron.engine import transformer_config_for
    from fe_megatron.training.config import DataArgs, ParallelArgs, TrainConfig

    written_tokenizer = os.path.join(final_directory, os.path.relpath(tokenizer_path, directory))
    cfg = TrainConfig(model=backbone, memory=memory, parallel=ParallelArgs(table_sharding=table_sharding or "replicated"),
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
    with open(os.path.join(directory, "train.yaml"), "w") as fh:
        fh.write(train_yaml(cfg, source, os.path.abspath(written_tokenizer), final_directory, tp, pp, settings,
                            table_sharding))


# A short run's settings, for a model that comes without a run of fe_megatron's (a Llama, a graft):
# placeholders to review, not a recipe (the paper's is examples/configs/paper_*.yaml)
PLACEHOLDER_TRAINING = {"train_steps": 1000, "micro_batch_size": 1, "global_batch_size": 8, "log_interval": 10,
                        "eval_interval": 250, "eval_steps": 10, "save_interval": 250}
PLACEHOLDER_OPTIMIZER = {"warmup_steps": 100}
PLACEHOLDER_SPLIT = "90,5,5"


def train_yaml(cfg, source, tokenizer: str, run_directory: str, tp: int, pp: int, settings: Optional[dict],
               table_sharding: Optional[str] = None) -> str:
    """``train.yaml`` of a converted run: the model and memory of the weights, the parallel layout asked
    for, and either the training settings of the run the weights come from (``settings``: a
    transformers directory written by ``mcore-to-hf``/``deepspeed-to-hf`` records them) or short
    placeholders.  Its header says which, and what the user must set; ``fe-convert`` prints it."""
    import yaml

    train = dataclasses.asdict(cfg)
    for key in ("save", "load", "tensorboard_dir"):
        train.pop(key)
    if train["memory"] is not None:
        train["memory"].pop("backbone")
    command = (f"fe-pretrain --config {os.path.join(run_directory, 'train.yaml')} --load {run_directory} "
               f"--save {run_directory}")
    if settings is not None:
        carried = settings.get("config") or {}
        for section in ("parallel", "optimizer", "training", "data"):
            train[section].update(carried.get(section) or {})
        engine = train["training"].get("engine", "megatron")
        # the weights are a Megatron checkpoint now: the DeepSpeed engine's own settings do not carry over,
        # and neither does a one-off stop of the run they come from
        train["training"].update(engine="megatron", exit_after=0)
        train["deepspeed"] = None
        if train["parallel"].get("table_sharding") not in MEGATRON_TABLE_SHARDINGS:
            train["parallel"]["table_sharding"] = "replicated"
        header = [f"Written by fe-convert from {source}, with the training settings of the run it was converted "
                  f"from ({settings.get('converted_from')}).",
                  "A new run starts from these weights at step 0 with a fresh optimizer and this schedule: "
                  f"training.train_steps={train['training']['train_steps']} and optimizer.warmup_steps="
                  f"{train['optimizer']['warmup_steps']} are that run's; change them to continue on purpose"
                  + (f" (that run used training.engine={engine}; this checkpoint is the Megatron engine's)."
                     if engine != "megatron" else "."),
                  f"Continue with: {command}"]
    else:
        train["training"].update(PLACEHOLDER_TRAINING)
        train["optimizer"].update(PLACEHOLDER_OPTIMIZER)
        train["data"]["split"] = PLACEHOLDER_SPLIT
        header = [f"Written by fe-convert from {source}, which records no training run: the training settings "
                  "below are short placeholders, not a recipe.",
                  "Set data.train_data (the prefix of fe-data preprocess's output), and review "
                  + ", ".join(f"training.{k}={v}" for k, v in PLACEHOLDER_TRAINING.items()
                              if k in ("train_steps", "global_batch_size", "micro_batch_size"))
                  + f", optimizer.lr={train['optimizer']['lr']}, optimizer.warmup_steps="
                  f"{PLACEHOLDER_OPTIMIZER['warmup_steps']} and data.split={PLACEHOLDER_SPLIT}.",
                  f"Continue with: {command} data.train_data=[PREFIX]"]
    train["parallel"].update(tensor=tp, pipeline=pp)
    if table_sharding is not None:  # given on the command line: it wins over the run's
        train["parallel"]["table_sharding"] = table_sharding
    if train["parallel"].get("table_sharding") == "node" and isinstance(train.get("memory"), dict):
        train["memory"]["table_placement"] = "host"  # node-shared tables live in host memory
    train["data"]["tokenizer_model"] = tokenizer
    return "".join(f"# {line}\n" for line in header) + yaml.safe_dump(train, sort_keys=False)


def train_yaml_header(run_directory: str) -> list:
    """The comment lines at the top of ``run_directory/train.yaml``, without their ``# ``."""
    lines = []
    with open(os.path.join(run_directory, "train.yaml")) as fh:
        for line in fh:
            if not line.startswith("# "):
                break
            lines.append(line[2:].rstrip("\n"))
    return lines


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

