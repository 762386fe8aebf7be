"""Where a run starts: ``--load`` and ``--save`` checked together, the same way for both engines.

* no ``--load``: a new run, from step 0;
* ``--load`` of a run directory with a checkpoint: resume from its newest intact checkpoint,
  after the resume guards (`fe_megatron.checkpoint.resume_guard`);
* ``--load`` of a Hugging Face model directory: its weights start a new run (DeepSpeed engine);
* ``--load`` of a folder without checkpoints (not there yet, empty, or holding only the logs of
  a start that never saved): a new run only when it is also ``--save`` (the launch scripts'
  first start: every restart afterwards resumes there).

Everything else is refused with what a run directory holds: a file, a folder holding something
else (a tokenizer, data), a run of the other engine.  A new run is never written into a
``--save`` folder that already holds another run's checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from fe_megatron.checkpoint.files import (RUN_INFO, TRACKER, CheckpointError, complete_iterations, iteration_dir,
                                          read_run_info)
from fe_megatron.checkpoint.reader import DEEPSPEED_LATEST, run_engine

RUN_DIRECTORY = (f"a run directory is fe-pretrain's --save folder: it holds {TRACKER} (the newest checkpoint's "
                 f"iteration) and iter_NNNNNNN/ checkpoint folders, each with {RUN_INFO} and fe_manifest.json")


@dataclasses.dataclass
class StartPoint:
    """``kind``: "new" (step 0, fresh weights), "checkpoint" (``folder`` is a verified checkpoint of
    this engine, ``saved`` its run info) or "hf" (``folder`` is a Hugging Face model directory)."""

    kind: str
    folder: Optional[str] = None
    saved: Optional[dict] = None


def holds_checkpoints(directory: Optional[str]) -> bool:
    """Whether ``directory`` holds checkpoints of a run (of either engine)."""
    if not directory or not os.path.isdir(directory):
        return False
    return (os.path.isfile(os.path.join(directory, TRACKER)) or bool(complete_iterations(directory))
            or os.path.isfile(os.path.join(directory, DEEPSPEED_LATEST)))


def _same_folder(a: str, b: Optional[str]) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def start_point(cfg, engine: str, find, log) -> StartPoint:
    """Where the run configured by ``cfg`` starts (see the module's docstring).  ``engine`` is
    "megatron" or "deepspeed"; ``find(directory)`` returns the verified checkpoint folder of a run
    directory of that engine (None: none yet).  The resume guards are the caller's."""
    load, save = cfg.load, cfg.save
    if not load:
        _refuse_foreign_save(save, "")
        return StartPoint("new")
    if os.path.isfile(load):
        raise CheckpointError(f"--load {load} is a file; --load takes a run directory to resume ({RUN_DIRECTORY})"
                              + ("" if engine == "megatron" else ", or a Hugging Face model directory"))
    if os.path.isfile(os.path.join(load, "config.json")):
        if engine != "deepspeed":
            raise CheckpointError(f"--load {load} is a Hugging Face model directory; the Megatron engine starts from "
                                  f"fe-pretrain checkpoints: run fe-convert hf-to-mcore --input {load} --output NEW_DIR, "
                                  "then --load NEW_DIR")
        _refuse_foreign_save(save, load)
        return StartPoint("hf", load)
    if _same_folder(load, save) and not holds_checkpoints(load):  # e.g. a restart before the first save
        log(f"--load {load} holds no checkpoint yet and is also --save: starting a new run there from step 0 "
            "(later starts resume from its checkpoints)")
        return StartPoint("new")
    if not os.path.isdir(load):
        raise CheckpointError(f"--load {load} does not exist: there is nothing to resume. Leave out --load to start a "
                              "new run, or give the same folder as --save (a first start that later starts resume)")
    if not holds_checkpoints(load):
        raise CheckpointError(f"--load {load} is not a run directory: it holds {_some_names(load)}. {RUN_DIRECTORY}. "
                              "Give the run's --save folder, or leave out --load to start a new run")
    _check_engine(load, engine)
    folder = find(load)
    if folder is None:
        leftovers = [os.path.basename(iteration_dir(load, it)) for it in complete_iterations(load)]
        if leftovers:  # folders neither a tracker nor a manifest vouches for: not ours to overwrite
            raise CheckpointError(f"--load {load} holds {', '.join(leftovers)} but no complete checkpoint (no {TRACKER}"
                                  f", and no folder with its fe_manifest.json): they were not written by fe-pretrain, "
                                  "or its save was stopped before it finished. Move them out of the way to start a "
                                  "new run there, or choose another --save folder")
        if _same_folder(load, save):
            log(f"--load {load} holds no complete checkpoint yet and is also --save: starting a new run there from "
                "step 0")
            return StartPoint("new")
        raise CheckpointError(f"--load {load} holds no complete checkpoint yet: nothing to resume")
    if not _same_folder(load, save):
        _refuse_foreign_save(save, load)
    return StartPoint("checkpoint", folder, read_run_info(folder))


def _refuse_foreign_save(save: Optional[str], load: str) -> None:
    """A new run (or a branch of ``load``) must not write into checkpoints already in ``save``."""
    if not holds_checkpoints(save):
        return
    if not load:
        raise CheckpointError(f"--save {save} already holds another run's checkpoints; resume it with --load {save}, "
                              "or choose a new --save folder (fe-pretrain never writes a new run over an old one)")
    raise CheckpointError(f"--save {save} already holds checkpoints, so this start would not continue them from "
                          f"--load {load}: they are another run's, or this branch's own from an earlier start. To "
                          f"continue a branch after its first save, relaunch with --load {save} --save {save}; "
                          "otherwise choose a new --save folder (fe-pretrain never writes over another run)")


def _check_engine(load: str, engine: str) -> None:
    """Refuse a run directory written by the other engine, naming the conversion that bridges them."""
    deepspeed_run = run_engine(load) == "deepspeed"
    if engine == "megatron" and deepspeed_run:
        raise CheckpointError(f"--load {load} is a run of the DeepSpeed engine (training.engine=deepspeed); resume it "
                              "with that engine, or fe-convert deepspeed-to-hf then hf-to-mcore for the Megatron "
                              "engine")
    if engine == "deepspeed" and not deepspeed_run:
        raise CheckpointError(f"--load {load} holds Megatron-engine checkpoints; the DeepSpeed engine starts from a "
                              "Hugging Face directory: fe-convert mcore-to-hf it, then --load the output")


def _some_names(directory: str) -> str:
    names = sorted(os.listdir(directory))
    if not names:
        return "nothing"
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


@dataclasses.dataclass
class RunStart:
    """What an engine settles before it builds a model (`start_run`)."""

    info: dict  # the run info its checkpoints carry, with the schedule in force
    start_at: object  # the StartPoint: "new", "checkpoint" or "hf", and its folder
    weights_only: bool  # it starts from weights without optimizer state (a conversion's, or a Hugging Face model)
    datasets: tuple


def start_run(cfg, engine: str, data_parallel_size: int, plan, layout: dict = None,
              find_checkpoint=None, refuse_table_change=None, holds_weights_only=None) -> RunStart:
    """Step 2 of both engines' set-up (`fe_megatron.training.run`).  ``layout``: the engine's own
    entries of the run info's layout; ``find_checkpoint(directory)``: the engine's verified
    checkpoint folder; ``refuse_table_change(folder, saved_info, info)``: its check that the
    tables' optimizer state loads; ``holds_weights_only(folder)``: whether a checkpoint of it holds
    weights alone (a conversion's)."""
    from fe_megatron.checkpoint import resume_guard
    from fe_megatron.checkpoint.run_info import run_info
    from fe_megatron.training.distributed import log
    from fe_megatron.training.run import load_run_tokenizer, run_datasets

    tokenizer = load_run_tokenizer(cfg)
    info = run_info(cfg, data_parallel_size, layout)
    if plan is not None:
        info["tables"] = plan.mode  # how the tables are trained, which a resumed run must match
    start_at = start_point(cfg, engine, find_checkpoint, log)
    checkpoint = start_at.kind == "checkpoint"
    weights_only = start_at.kind == "hf" or (checkpoint and holds_weights_only is not None
                                             and holds_weights_only(start_at.folder))
    if checkpoint:
        resume_guard.guard(start_at.folder, start_at.saved, info, log, weights_only=weights_only)
        if not weights_only and refuse_table_change is not None:
            refuse_table_change(start_at.folder, start_at.saved, info)
    # a resumed run keeps its checkpoint's schedule; a new one, or weights alone, follows the config
    info["schedule"] = resume_guard.schedule_in_force(start_at.saved if checkpoint and not weights_only else None,
                                                      info)
    return RunStart(info, start_at, weights_only, run_datasets(cfg, tokenizer, data_parallel_size))
