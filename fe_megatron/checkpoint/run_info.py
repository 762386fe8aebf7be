"""The run info every checkpoint records (``fe_run.json``), for every engine: the resolved
config, the tokenizer's path and checksum, and the parallel layout that wrote it."""

from __future__ import annotations

import dataclasses
import os
import platform
from importlib import metadata

import torch.distributed as dist

from fe_megatron.checkpoint.files import file_digest


def run_info(cfg, data_parallel_size: int, engine: dict = None, world_size: int = None) -> dict:
    """What every checkpoint records about the run that wrote it: the resolved config, the
    tokenizer and its checksum, and the parallel layout (plus ``engine``'s own settings, e.g. the
    engine's name and ZeRO stage). ``world_size``: the run's (default: this process group's)."""
    from fe_megatron import __version__
    from fe_megatron.data.tokenizer import tokenizer_file

    p = cfg.parallel
    world = dist.get_world_size() if world_size is None else world_size
    layout = {"world": world, "tensor": p.tensor, "pipeline": p.pipeline,
              "data": data_parallel_size, "table_sharding": p.table_sharding}
    layout.update(engine or {})
    return {"config": dataclasses.asdict(cfg), "fe_megatron": __version__,
            "tokenizer": {"path": os.path.abspath(cfg.data.tokenizer_model),
                          "sha256": file_digest(tokenizer_file(cfg.data.tokenizer_model))["sha256"]},
            "layout": layout, "stack": software_stack()}


def software_stack() -> dict:
    """The releases a checkpoint was written with (each None where it is not installed)."""
    versions = {"python": platform.python_version()}
    for name in ("torch", "megatron-core", "deepspeed", "transformers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
