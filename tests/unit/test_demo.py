"""fe-demo (`fe_megatron.demo`) without its training runs: the paired throughput measurement and what the
command refuses outside a repository; the demo's short run is tests/integration/test_demo.py, the command
refusing zero steps tests/integration/test_commands.py."""

import os

import pytest


def test_the_demo_times_both_models_alternately_so_that_they_meet_the_same_load():
    """Two fe-pretrain processes one after the other met different loads on a busy machine (their
    tokens/s ratio 0.48 to 0.85); the demo's throughput is one step of each model in turn, and the
    medians leave out the steps that waited for a core."""
    from types import SimpleNamespace

    from fe_megatron.demo import time_alternating_steps

    calls, now = [], [0.0]

    def fake_run(kind, step_seconds):
        def train_step(batches):
            calls.append((kind, batches))
            now[0] += step_seconds[(len(calls) - 1) // 2]

        cfg = SimpleNamespace(training=SimpleNamespace(global_batch_size=4), model=SimpleNamespace(seq_length=8))
        return SimpleNamespace(cfg=cfg, datasets=("train", "valid", "test"), num_microbatches=2,
                               batches=lambda dataset, first, n: (dataset, first, n), train_step=train_step,
                               advance_schedule=lambda: None)

    # the first step is the warm-up; the third step of the factorengram model waits for a core
    record = time_alternating_steps({"factorengram": fake_run("factorengram", [9.0, 0.5, 0.5, 8.0, 0.5]),
                                     "transformer": fake_run("transformer", [9.0, 0.25, 0.25, 0.25, 0.25])},
                                    steps=4, warmup_steps=1, clock=lambda: now[0])
    assert [kind for kind, _ in calls] == ["factorengram", "transformer"] * 5
    assert [batches for kind, batches in calls if kind == "transformer"] == [("train", first, 2) for first in
                                                                             (0, 4, 8, 12, 16)]
    assert record["method"] == "paired"
    assert record["order"] == "alternating: factorengram, transformer, factorengram, ..."
    assert record["steps_per_model"] == 4 and record["warmup_steps_per_model"] == 1
    assert record["step_seconds"] == {"factorengram": [0.5, 0.5, 8.0, 0.5], "transformer": [0.25] * 4}
    assert record["tokens_per_s"] == {"factorengram": 64.0, "transformer": 128.0}  # 32 tokens per median step
    assert record["mean_tokens_per_s"] == {"factorengram": 128 / 9.5, "transformer": 128.0}
    assert record["ratio"] == 0.5 and record["ratio_of"] == "factorengram / transformer"
    assert set(record["load_average_1min"]) == {"before", "after"} and record["cpus"] == os.cpu_count()


def test_fe_demo_outside_a_repository_says_what_it_needs(monkeypatch, tmp_path, capsys):
    from fe_megatron import demo

    monkeypatch.setattr(demo, "CORPUS", str(tmp_path / "data" / "sotu.jsonl.gz"))
    with pytest.raises(SystemExit, match=r"sotu\.jsonl\.gz is missing\. fe-demo runs from a clone of the fe_megatron "
                                         r"repository .*run `make demo` in it"):
        demo.main(["--out", str(tmp_path / "out")])
    assert not os.path.exists(tmp_path / "out")
