"""Resume guards: what may change between a checkpoint's config and the run that loads it.

Fields that set a parameter's shape, or the address of a table row, are refused when they
change: the checkpoint would fail to load deep inside the loader, or (for the hash seed, the
orders, the capacities, the compression or the tokenizer) load silently and readdress every
row, losing what the tables learned.  Every other change (learning rate, steps, intervals, the
parallel layout, ...) is allowed and reported.
"""

from __future__ import annotations

from typing import Optional

# (section, field): why a change is refused
GUARDED = {
    ("model", "vocab_size"): "the embedding's and the unigram tables' rows",
    ("model", "hidden_size"): "every weight's shape",
    ("model", "num_layers"): "the layers",
    ("model", "num_attention_heads"): "the attention's shapes",
    ("model", "num_query_groups"): "the attention's key and value shapes",
    ("model", "ffn_hidden_size"): "the MLP's shapes",
    ("model", "tie_embeddings"): "the output layer",
    ("memory", "kind"): "the memory branch's parameters",
    ("memory", "hash_seed"): "the address of every hashed table row",
    ("memory", "ngram_orders"): "the branches and the address of every row",
    ("memory", "heads_per_order"): "the branches and the address of every row",
    ("memory", "table_capacity"): "the tables' rows and the address of every hashed row",
    ("memory", "token_compression"): "the ids the rows are addressed by",
    ("memory", "coeff_width"): "the tables' and the dictionary's shapes",
    ("memory", "memory_dim"): "the dictionary's and the projections' shapes",
    ("memory", "layers"): "which layers hold memory",
    ("memory", "gate"): "the gate's parameters",
    ("memory", "placement"): "where the memory is added, and its output width",
    ("memory", "conv_kernel_size"): "the convolution's shape",
    ("memory", "conv_dilation"): "which positions the convolution reads",
    ("optimizer", "table_lr_mult"): "the optimizer's parameter groups, which the checkpoint's optimizer state "
                                    "is loaded by",
    ("optimizer", "table_weight_decay_mult"): "the optimizer's parameter groups, which the checkpoint's optimizer "
                                              "state is loaded by (before release 0.2 its default was 0.0)",
    ("tokenizer", "sha256"): "the meaning of every token id",
}


def _get(info: dict, section: str, name: str):
    if section == "tokenizer":
        return (info.get("tokenizer") or {}).get(name)
    part = (info.get("config") or {}).get(section)
    return None if part is None else part.get(name)


def _flatten(tree, prefix: str = "") -> dict:
    out = {}
    for key, value in (tree or {}).items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def compare(saved: Optional[dict], current: dict, weights_only: bool = False) -> tuple:
    """``(refused, changed)``: messages for guarded fields that differ, and ``"field: old -> new"`` for the rest.

    ``saved`` and ``current`` are run infos (``fe_run.json``): ``{"config": {...}, "tokenizer": {...}}``.
    A checkpoint without one (written before run infos existed) is not compared.  A weights-only
    checkpoint (``weights_only``: a conversion's, no optimizer state) guards no optimizer field."""
    if saved is None:
        return [], []
    refused = []
    saved_memory, current_memory = (saved.get("config") or {}).get("memory"), current["config"].get("memory")
    if (saved_memory is None) != (current_memory is None):
        def describe(memory):
            return "no memory (a plain Transformer)" if memory is None else f"memory kind {memory['kind']!r}"

        refused.append(f"memory: the checkpoint has {describe(saved_memory)}, this run has {describe(current_memory)}")
    for (section, name), why in GUARDED.items():
        if section == "memory" and (saved_memory is None or current_memory is None):
            continue
        if section == "optimizer" and weights_only:
            continue
        old, new = _get(saved, section, name), _get(current, section, name)
        if old != new:
            refused.append(f"{section}.{name} is {old!r} in the checkpoint and {new!r} now; it sets {why}")
    flat_old = _flatten(saved.get("config"))
    flat_new = _flatten(current["config"])
    guarded = {f"{section}.{name}" for section, name in GUARDED}
    changed = [f"{key}: {flat_old.get(key)!r} -> {flat_new.get(key)!r}" for key in sorted(set(flat_old) | set(flat_new))
               if flat_old.get(key) != flat_new.get(key) and not key.startswith("memory.backbone.")
               and key not in guarded and key not in ("load", "save")]
    return refused, changed


def guard(folder: str, saved: dict, info: dict, log, weights_only: bool = False) -> None:
    """Refuse to resume from ``folder`` (run info ``saved``) when a guarded setting of this run
    (``info``) differs; ``log`` the other changes."""
    from fe_megatron.checkpoint.files import CheckpointError

    refused, changed = compare(saved, info, weights_only=weights_only)
    if refused:
        raise CheckpointError(f"cannot resume from {folder}; these settings differ from the checkpoint's:\n  "
                              + "\n  ".join(refused) + "\nRestore them, or start a new run in another --save "
                              "directory without --load.")
    for line in changed:
        log(f"changed since the checkpoint: {line}")
    note = None if weights_only else schedule_note(saved, info)
    if note:
        log(note)


# The learning-rate schedule's settings: a resumed run keeps the checkpoint's (both engines).
SCHEDULE = (("optimizer", "lr"), ("optimizer", "min_lr"), ("optimizer", "warmup_steps"), ("training", "train_steps"))


def schedule_note(saved: Optional[dict], current: dict) -> Optional[str]:
    """What a resumed run's learning rate does when a schedule setting changed, or None."""
    if saved is None:
        return None
    changed = [(f"{section}.{name}", _get(saved, section, name), _get(current, section, name))
               for section, name in SCHEDULE if _get(saved, section, name) != _get(current, section, name)]
    if not changed:
        return None
    listed = ", ".join(f"{key} {old} -> {new}" for key, old, new in changed)
    note = (f"note: the learning-rate schedule is the checkpoint's, so {listed} does not change it: the rate "
            f"follows the saved warm-up and cosine decay")
    old_steps, new_steps = _get(saved, "training", "train_steps"), _get(current, "training", "train_steps")
    if old_steps is not None and new_steps is not None and new_steps > old_steps:
        note += f" and stays at the saved min_lr after step {old_steps}"
    return note + (". To train on a new schedule, start a new run from these weights (fe-convert "
                   "mcore-to-hf / deepspeed-to-hf, then --load the converted model)")
