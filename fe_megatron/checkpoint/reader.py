"""Reading a run directory, for every consumer (``fe-convert``, ``fe-eval``, ``fe-inspect``, the
tests): which engine wrote it, the checkpoint folder to read (verified against its manifest),
and the model's configs from its run info.  Plain Python; no process group needed."""

from __future__ import annotations

import os
from typing import Optional

from fe_megatron.checkpoint.files import (RUN_INFO, TRACKER, CheckpointError, checkpoint_problems, complete_iterations,
                                          iteration_dir, read_run_info, read_tracker)
from fe_megatron.config import BackboneConfig, MemoryConfig

DEEPSPEED_LATEST = "latest"  # DeepSpeed's own pointer to the newest checkpoint's tag


class NotARunError(CheckpointError):
    """The path given is not a run directory (or checkpoint folder) of the expected engine."""


CONVERTERS = {"megatron": "mcore-to-hf", "deepspeed": "deepspeed-to-hf"}
ENGINE_NAMES = {"megatron": "Megatron", "deepspeed": "DeepSpeed"}


def run_engine(path: str) -> str:
    """"megatron" or "deepspeed": the engine that wrote the run directory (or checkpoint folder)
    ``path``: DeepSpeed's ``latest``, else the run info of the folder or of its newest checkpoint
    (a DeepSpeed run stopped before its first ``latest`` was written has only that)."""
    if os.path.isfile(os.path.join(path, DEEPSPEED_LATEST)):
        return "deepspeed"
    folder = path
    if not os.path.isfile(os.path.join(path, RUN_INFO)):
        iterations = complete_iterations(path)
        folder = iteration_dir(path, iterations[-1]) if iterations else path
    info = read_run_info(folder) if os.path.isfile(os.path.join(folder, RUN_INFO)) else None
    return ((info or {}).get("layout") or {}).get("engine", "megatron")


def find_checkpoint_folder(load: str, iteration: Optional[int] = None, engine: str = "megatron",
                           require_run_info: bool = True) -> str:
    """The ``iter_NNNNNNN`` folder of run directory ``load`` to read: ``iteration``, or the
    tracker's, verified against its manifest (`CheckpointError` names a damaged file).  ``load`` may
    also be such a folder itself.  Anything else, and a run of another engine than ``engine``, is
    refused with `NotARunError`, naming what to give instead."""
    if not os.path.isdir(load):
        raise NotARunError(f"--load {load}: no such directory; give an fe-pretrain run directory (its --save)")
    if os.path.isfile(os.path.join(load, RUN_INFO)) and iteration is None:
        folder = load
    else:
        iterations = complete_iterations(load)
        if not iterations:
            raise NotARunError(f"--load {load} is not an fe-pretrain checkpoint directory: it has no "
                                  "iter_NNNNNNN checkpoint folder (give the run's --save directory)")
        for candidate in (iteration, read_tracker(load), _latest_iteration(load), iterations[-1]):
            if candidate is not None:
                iteration = candidate
                break
        if iteration not in iterations:
            raise NotARunError(f"--iteration {iteration}: {load} has checkpoints at iterations {iterations}")
        folder = iteration_dir(load, iteration)
    wrote = run_engine(folder) if os.path.isfile(os.path.join(folder, RUN_INFO)) else run_engine(load)
    if wrote != engine:
        raise NotARunError(f"{load} is a run of the {ENGINE_NAMES[wrote]} engine (training.engine={wrote}), not of "
                              f"the {ENGINE_NAMES[engine]} engine: use fe-convert {CONVERTERS[wrote]} for it")
    run_directory = os.path.dirname(os.path.abspath(folder))
    legacy = engine == "deepspeed" and not os.path.isfile(os.path.join(run_directory, TRACKER))
    problems = [] if legacy else checkpoint_problems(folder)  # DeepSpeed runs saved before manifests
    if problems:
        raise CheckpointError(f"checkpoint {folder} is damaged:\n  " + "\n  ".join(problems))
    if require_run_info and read_run_info(folder) is None:
        raise NotARunError(f"{folder} has no {RUN_INFO} (the run's config): it was written before fe-pretrain "
                              "recorded one, or by another program. Resume the run with fe-pretrain --load (or "
                              "fe_megatron.megatron_lm.pretrain_gpt --load, for a Megatron-LM run) until its next "
                              "save, which records it")
    return folder


def _latest_iteration(directory: str) -> Optional[int]:
    """The iteration DeepSpeed's ``latest`` names (runs saved before they had a tracker), or None."""
    path = os.path.join(directory, DEEPSPEED_LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        tag = fh.read().strip()
    return int(tag[len("iter_"):]) if tag.startswith("iter_") and tag[len("iter_"):].isdigit() else None


def configs_of(info: dict) -> tuple:
    """``(BackboneConfig, MemoryConfig or None)`` from a checkpoint's run info."""
    config = info["config"]
    backbone = BackboneConfig(**config["model"])
    memory = None
    if config.get("memory") is not None:
        fields = {k: v for k, v in config["memory"].items() if k != "backbone"}
        memory = MemoryConfig(backbone=backbone, **fields)
    return backbone, memory
