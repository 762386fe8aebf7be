"""`fe_megatron.checkpoint.resume_guard`: every guarded change is refused naming both values, allowed
changes are listed, and a changed schedule is explained on resume."""

import json

from fe_megatron.checkpoint import resume_guard
from tests.helpers.training import CONFIG, small_overrides


def test_resume_guards_refuse_every_guarded_change_naming_both_values(small_data):
    from fe_megatron.training.config import load_train_config

    base = load_train_config(CONFIG, small_overrides(small_data))

    def info(cfg, sha="a" * 64):
        import dataclasses

        return {"config": dataclasses.asdict(cfg), "tokenizer": {"sha256": sha}}

    changes = {"model.vocab_size": 1024, "model.hidden_size": 64, "model.num_layers": 6, "model.num_attention_heads": 8,
               "model.num_query_groups": 2, "optimizer.table_lr_mult": 2.0, "optimizer.table_weight_decay_mult": 1.0,
               "model.ffn_hidden_size": 256, "model.tie_embeddings": False, "memory.hash_seed": 3,
               "memory.ngram_orders": [1, 2], "memory.heads_per_order": 1, "memory.table_capacity": [512, 4096, 4099],
               "memory.coeff_width": 96, "memory.memory_dim": 64, "memory.layers": [0], "memory.gate": "scalar",
               "memory.placement": "before_ffn", "memory.conv_kernel_size": 3, "memory.conv_dilation": 2,
               "memory.kind": "engram", "memory.token_compression": small_data["tokenizer"], "model.num_experts": 4}
    assert {key for key in changes} | {"tokenizer.sha256"} == {f"{a}.{b}" for a, b in resume_guard.GUARDED}
    for key, value in changes.items():
        overrides = small_overrides(small_data, **{key: json.dumps(value)})
        if key == "model.vocab_size":
            overrides += ["memory.table_capacity=[1024, 4096, 4096]"]
        if key == "memory.kind":
            overrides += ["memory.gate=scalar", "memory.memory_dim=192"]
        if key == "memory.ngram_orders":
            overrides += ["memory.table_capacity=[512, 4096]", "memory.coeff_width=128"]
        refused, _ = resume_guard.compare(info(base), info(load_train_config(CONFIG, overrides)))
        assert len(refused) >= 1 and any(line.startswith(f"{key} is ") for line in refused), (key, refused)
    refused, _ = resume_guard.compare(info(base), info(base, sha="b" * 64))
    assert refused == [f"tokenizer.sha256 is {'a' * 64!r} in the checkpoint and {'b' * 64!r} now; it sets the "
                       "meaning of every token id"]
    refused, _ = resume_guard.compare(info(base), info(load_train_config(CONFIG, small_overrides(small_data) +
                                                                         ["memory=null"])))
    assert refused == ["memory: the checkpoint has memory kind 'factorengram', this run has no memory (a plain "
                       "Transformer)"]
    allowed = load_train_config(CONFIG, small_overrides(small_data, **{"optimizer.lr": 0.01, "parallel.tensor": 2,
                                                                        "training.train_steps": 20}))
    refused, changed = resume_guard.compare(info(base), info(allowed))
    assert refused == [] and set(changed) == {"optimizer.lr: 0.003 -> 0.01", "parallel.tensor: 1 -> 2",
                                              "training.train_steps: 8 -> 20"}
    # fields added since the first checkpoints: an older run info without them ran with their defaults
    older = info(base)
    for section, name in resume_guard.ADDED_FIELDS:
        del older["config"][section][name]
    assert resume_guard.compare(older, info(base)) == ([], [])
    # an expert-parallel backbone's optimizer state loads across expert-parallel sizes above 1 only
    moe = small_overrides(small_data, **{"model.num_experts": 4})
    one, two, four = (info(load_train_config(CONFIG, moe + [f"parallel.expert={n}"])) for n in (1, 2, 4))
    assert resume_guard.compare(two, four)[0] == []
    refused, _ = resume_guard.compare(two, one)
    assert len(refused) == 1 and refused[0].startswith("parallel.expert is 2 in the checkpoint and 1 now")
    assert resume_guard.compare(two, one, weights_only=True)[0] == []


def test_a_changed_schedule_is_explained_on_resume():
    from fe_megatron.checkpoint.resume_guard import guard, schedule_in_force

    def info(steps, lr=1e-3, schedule=None):
        run = {"config": {"training": {"train_steps": steps},
                          "optimizer": {"lr": lr, "min_lr": 1e-4, "warmup_steps": 10, "weight_decay": 0.1}}}
        return run if schedule is None else dict(run, schedule=schedule)

    logged = []
    guard("ckpt", info(300), info(600), logged.append)
    note = [line for line in logged if line.startswith("note:")]
    assert note and "training.train_steps 600 (in force: 300) does not change it" in note[0]
    assert "stays at min_lr 0.0001 after step 300" in note[0]
    logged.clear()
    guard("ckpt", info(300), info(300, lr=2e-3), logged.append)
    assert any("optimizer.lr 0.002 (in force: 0.001) does not change it" in line for line in logged)
    logged.clear()
    guard("ckpt", info(300), info(600), logged.append, weights_only=True)  # a conversion: a fresh schedule
    assert not [line for line in logged if line.startswith("note:")]

    # A second resume: the checkpoint's config already says 600 steps, but the schedule it
    # followed (and records) is still the first run's.
    kept = schedule_in_force(info(300), info(600))
    assert kept["decay_steps"] == 300 and kept["weight_decay"] == 0.1
    second = info(600, schedule=kept)
    assert schedule_in_force(second, info(600)) == kept
    logged.clear()
    guard("ckpt", second, info(600), logged.append)
    assert any("training.train_steps 600 (in force: 300)" in line for line in logged)
