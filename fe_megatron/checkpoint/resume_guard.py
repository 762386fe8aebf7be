"""Resume guards: what may change between a checkpoint's config and the run that loads it.

Fields that set a parameter's shape, or the address of a table row, are refused when they
change: the checkpoint would fail to load deep inside the loader, or (for the hash seed, the
orders, the capacities, the compression or the tokenizer) load silently and readdress every
row, losing what the tables learned.  Every other change (learning rate, steps, intervals, the
parallel layout, ...) is allowed and reported.
"""

from __future__ import annotations

from typing import Optional

from fe_megatron.tables.update_rules import RULES


def _state_words(layout: Optional[tuple]) -> str:
    """A rule's optimizer state (`UpdateRule.state_layout`) in words."""
    if layout is None:
        return "an unknown rule's"
    return " and ".join(f"{key} per {'row' if per_row else 'parameter'}" for key, per_row in layout)


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
    ("model", "num_experts"): "the FFN's experts",
}

# fields added after checkpoints were first written, with the value an older checkpoint ran with
ADDED_FIELDS = {("optimizer", "table_update"): "adamw", ("model", "num_experts"): 0, ("model", "moe_router_topk"): 2,
                ("model", "moe_aux_loss_coeff"): 0.01, ("parallel", "expert"): 1}


def _get(info: dict, section: str, name: str):
    if section == "tokenizer":
        return (info.get("tokenizer") or {}).get(name)
    part = (info.get("config") or {}).get(section)
    return None if part is None else part.get(name, ADDED_FIELDS.get((section, name)))


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
    old, new = (_get(info, "parallel", "expert") or 1 for info in (saved, current))
    if (old > 1) != (new > 1) and not weights_only:
        refused.append(f"parallel.expert is {old} in the checkpoint and {new} now; Megatron keeps the experts of an "
                       "expert-parallel backbone, and their optimizer state, apart from the other weights, so the "
                       "optimizer state does not load across expert-parallel sizes 1 and above 1 (sizes above 1 "
                       "reshard)")
    if saved_memory is not None and current_memory is not None and not weights_only:
        old, new = _get(saved, "optimizer", "table_update"), _get(current, "optimizer", "table_update")
        layouts = [RULES[name].state_layout if name in RULES else None for name in (old, new)]
        if old != new and layouts[0] != layouts[1]:  # adamw and lazy_adam keep the same two moments
            refused.append(f"optimizer.table_update is {old!r} in the checkpoint and {new!r} now; their optimizer "
                           f"states differ ({_state_words(layouts[0])} against {_state_words(layouts[1])}), so the "
                           "tables' optimizer state does not carry over")
    added = {f"{section}.{name}": value for (section, name), value in ADDED_FIELDS.items()}
    flat_old = dict(added, **_flatten(saved.get("config")))
    flat_new = dict(added, **_flatten(current["config"]))
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


# The schedule a run follows: its learning rate (warm-up, cosine decay to ``min_lr`` over
# ``decay_steps``) and weight decay, by name, with the config field that sets it for a new run.
# A resumed run keeps its checkpoint's (Megatron's OptimizerParamScheduler restores its own; the
# DeepSpeed engine reads it from the run info), so each run info records the one in force.
SCHEDULE = {"lr": ("optimizer", "lr"), "min_lr": ("optimizer", "min_lr"),
            "warmup_steps": ("optimizer", "warmup_steps"), "decay_steps": ("training", "train_steps"),
            "weight_decay": ("optimizer", "weight_decay")}


def configured_schedule(info: dict) -> dict:
    """The schedule run info ``info``'s config sets (what a new run follows)."""
    return {key: _get(info, section, name) for key, (section, name) in SCHEDULE.items()}


def schedule_in_force(saved: Optional[dict], info: dict) -> dict:
    """The schedule the run of ``info`` follows: for a resumed run the checkpoint's (run info
    ``saved``: its ``"schedule"``, or for checkpoints written before it was recorded, its config's),
    for a new run (``saved`` None), or with ``training.schedule_on_resume: config``, its own config's."""
    if saved is None or _get(info, "training", "schedule_on_resume") == "config":
        return configured_schedule(info)
    return dict(saved.get("schedule") or configured_schedule(saved))


def schedule_note(saved: Optional[dict], current: dict) -> Optional[str]:
    """What a resumed run's schedule does when this run's config asks for another one, or None."""
    if saved is None:
        return None
    if _get(current, "training", "schedule_on_resume") == "config":
        before = schedule_in_force(saved, {})
        changed = [f"{'.'.join(SCHEDULE[key])} {before[key]} -> {value}"
                   for key, value in configured_schedule(current).items() if before[key] != value]
        return (f"note: training.schedule_on_resume=config: from this step on the run follows this config's schedule "
                f"({', '.join(changed)})") if changed else None
    in_force, asked = schedule_in_force(saved, current), configured_schedule(current)
    changed = [f"{'.'.join(SCHEDULE[key])} {asked[key]} (in force: {in_force[key]})"
               for key in SCHEDULE if in_force[key] != asked[key]]
    if not changed:
        return None
    note = (f"note: a resumed run keeps its checkpoint's schedule, so {', '.join(changed)} does not change it: "
            "the rate follows the saved warm-up and cosine decay")
    if asked["decay_steps"] is not None and in_force["decay_steps"] is not None \
            and asked["decay_steps"] > in_force["decay_steps"]:
        note += f" and stays at min_lr {in_force['min_lr']} after step {in_force['decay_steps']}"
    return note + (". To extend the run on this config's schedule, resume with training.schedule_on_resume=config "
                   "(optimizer state and step count kept); to start over on a new schedule, start a new run from "
                   "these weights: fe-convert mcore-to-hf then hf-to-mcore, and --load its output (Megatron engine), "
                   "or fe-convert deepspeed-to-hf and --load the output (DeepSpeed engine)")
