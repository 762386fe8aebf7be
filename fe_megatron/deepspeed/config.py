"""The DeepSpeed JSON config of a run: read from ``deepspeed:`` (a path or inline keys), checked
against the training config, and completed from it.

The training config stays the single source of truth.  Every DeepSpeed key that restates one of
its values (batch sizes, precision, gradient clipping, the optimizer's hyperparameters) may be
left out or set to ``"auto"`` and is filled in; a value that contradicts it is refused with both
values named.  The optimizer and the learning-rate schedule are built from the ``optimizer``
section (AdamW with Megatron's parameter groups, `fe_megatron.deepspeed.engine`), so a JSON
``optimizer`` block is only checked, and a ``scheduler`` block is refused.
"""

from __future__ import annotations

import copy
import json
import math

from fe_megatron.config import ConfigError


def _refuse(key: str, given, ours: str, value, hint: str = "") -> None:
    raise ConfigError("deepspeed", f"{key}={given!r} contradicts {ours}={value!r}{hint}; make them agree, or "
                                   f"leave {key} out (or \"auto\") to take the training config's value", None, None)


def read_deepspeed_config(source) -> dict:
    """The config mapping from ``source``: a JSON file's path or a mapping (copied)."""
    if source is None:
        return {}
    if isinstance(source, dict):
        return copy.deepcopy(source)
    try:
        with open(source) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise ConfigError("deepspeed", f"the DeepSpeed config {source} does not exist", None, None) from None
    except json.JSONDecodeError as err:
        raise ConfigError("deepspeed", f"{source}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})", None,
                          None) from None


def _same(given, value) -> bool:
    if isinstance(value, float) or isinstance(given, float):
        return isinstance(given, (int, float)) and math.isclose(float(given), float(value), rel_tol=1e-9)
    return given == value


def resolve(cfg, data_parallel_size: int, bf16: bool) -> dict:
    """The DeepSpeed config for ``cfg`` at ``data_parallel_size`` ranks (``bf16``: the resolved
    training precision): the user's keys, checked, plus everything the training config implies."""
    ds = read_deepspeed_config(cfg.deepspeed)
    t, o = cfg.training, cfg.optimizer
    implied = {
        "train_batch_size": (t.global_batch_size, "training.global_batch_size"),
        "train_micro_batch_size_per_gpu": (t.micro_batch_size, "training.micro_batch_size"),
        "gradient_accumulation_steps": (t.global_batch_size // (t.micro_batch_size * data_parallel_size),
                                        f"training.global_batch_size / (micro_batch_size x {data_parallel_size} "
                                        "data-parallel ranks)"),
        "gradient_clipping": (float(o.clip_grad), "optimizer.clip_grad"),
    }
    for key, (value, ours) in implied.items():
        given = ds.get(key, "auto")
        if given != "auto" and not _same(given, value):
            _refuse(key, given, ours, value)
        ds[key] = value

    precision = "bf16" if bf16 else "fp32"
    fp16 = ds.get("fp16", {}) or {}
    if fp16.get("enabled") not in (None, False, "auto"):
        _refuse("fp16.enabled", fp16.get("enabled"), "training.precision", precision,
                " (fp16 with loss scaling is not offered; use training.precision=bf16)")
    ds["fp16"] = {"enabled": False}
    bf16_section = ds.get("bf16", {}) or {}
    enabled = bf16_section.get("enabled", "auto")
    if enabled != "auto" and bool(enabled) != bf16:
        _refuse("bf16.enabled", enabled, "training.precision", precision)
    ds["bf16"] = dict(bf16_section, enabled=bf16)

    zero = ds.setdefault("zero_optimization", {})
    stage = zero.setdefault("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError("deepspeed", f"zero_optimization.stage={stage!r} is not one of 0, 1, 2, 3", None, None)
    if zero.get("compute_grad_norm", True) is not True:
        raise ConfigError("deepspeed", f"zero_optimization.compute_grad_norm={zero['compute_grad_norm']!r}: "
                                       "fe-pretrain needs DeepSpeed's gradient norm: it logs it every step, clips the "
                                       "tables outside ZeRO by the same global norm, and recognizes a skipped "
                                       "(non-finite) update by it; remove zero_optimization.compute_grad_norm",
                          None, None)
    if stage == 3 and cfg.parallel.table_sharding in ("rows", "node"):
        zero.setdefault("stage3_param_persistence_threshold", 0)

    _check_optimizer(ds.pop("optimizer", None), o)
    if "scheduler" in ds:
        raise ConfigError("deepspeed", f"scheduler={ds['scheduler']!r}: the learning-rate schedule comes from the "
                                       "optimizer section (lr, min_lr, warmup_steps; cosine decay over "
                                       "training.train_steps, as Megatron's); remove deepspeed.scheduler", None, None)
    _check_checkpoint_writing(ds)
    ds.setdefault("steps_per_print", 2 ** 31 - 1)  # fe-pretrain logs every training.log_interval steps itself
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def _check_optimizer(block, o) -> None:
    """A JSON optimizer block must be Adam/AdamW with the optimizer section's values."""
    if block is None:
        return
    kind = str(block.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise ConfigError("deepspeed", f"optimizer.type={block.get('type')!r}: fe-pretrain trains with AdamW built "
                                       "from the optimizer section; remove deepspeed.optimizer or make it AdamW",
                          None, None)
    params = block.get("params", {}) or {}
    ours = {"lr": (o.lr, "optimizer.lr"), "weight_decay": (o.weight_decay, "optimizer.weight_decay"),
            "eps": (o.eps, "optimizer.eps"), "betas": ([o.beta1, o.beta2], "optimizer.beta1, beta2")}
    for key, (value, name) in ours.items():
        given = params.get(key, "auto")
        if given == "auto":
            continue
        if key == "betas":
            if len(given) != 2 or not all(_same(g, v) for g, v in zip(given, value)):
                _refuse(f"optimizer.params.{key}", given, name, value)
        elif not _same(given, value):
            _refuse(f"optimizer.params.{key}", given, name, value)


def _check_checkpoint_writing(ds: dict) -> None:
    """Refuse DeepSpeed settings that write checkpoints asynchronously or outside the save folder:
    fe-pretrain commits each checkpoint itself (written whole under ``iter_NNNNNNN.tmp``, hashed,
    renamed, then named by the tracker), which such a writer would bypass."""
    checkpoint = ds.get("checkpoint") or {}
    offending = []
    if checkpoint.get("writer") is not None:
        offending.append(f"checkpoint.writer={checkpoint['writer']!r}")
    if checkpoint.get("use_node_local_storage"):
        offending.append("checkpoint.use_node_local_storage=true")
    if ds.get("datastates_ckpt") not in (None, False):
        offending.append(f"datastates_ckpt={ds['datastates_ckpt']!r}")
    if (ds.get("nebula") or {}).get("enabled"):
        offending.append("nebula.enabled=true")
    if offending:
        raise ConfigError("deepspeed", f"{', '.join(offending)}: fe-pretrain commits every checkpoint itself (all "
                                       "files written, checksummed and renamed into place before the tracker "
                                       "names it; docs/deepspeed.md), which an asynchronous, decoupled or "
                                       "node-local checkpoint writer would bypass; remove these keys", None, None)


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))
