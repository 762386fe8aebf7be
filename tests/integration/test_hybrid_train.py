"""fe-pretrain with a hybrid backbone (``model.hybrid_layer_pattern``: megatron-core's HybridModel, 0.19 on).

A pattern of ``*-`` pairs is the GPT layer structure: an fe-pretrain GPT+memory checkpoint resumes as the
hybrid model with memory, and the next 10 steps follow the GPT run's curve, at one process (bit for bit),
TP=2, PP=2 with memory on the second stage only, DP=2 with row-sharded tables, and under full recompute.
The memory layers are given by the pattern's layer numbers (``memory.pattern_layers``) or by block.
"""

import pytest

from fe_megatron.megatron import compat
from tests.helpers.training import CONFIG, final_curve, resume_at, run_pretrain, small_overrides

pytestmark = pytest.mark.skipif(not compat.has_hybrid_model(), reason=(
    f"megatron-core {compat.megatron_core_version()} has no HybridModel ({compat.HYBRID_MINIMUM} on); "
    "`make test-newest` runs these tests"))

STEPS = 12
GPT = {"training.train_steps": STEPS, "training.save_interval": 2, "training.log_interval": 1,
       "training.eval_interval": STEPS, "memory.layers": "[2,3]"}  # blocks 2 and 3: the second of two stages
PATTERN = "model.hybrid_layer_pattern='*-*-*-*-'"


@pytest.fixture(scope="module")
def gpt_run(small_data, tmp_path_factory) -> str:
    save = str(tmp_path_factory.mktemp("gpt") / "gpt")
    run_pretrain(["--config", CONFIG, "--save", save] + small_overrides(small_data, **GPT))
    return save


LAYOUTS = {
    "1": (1, [PATTERN]),
    "tp2": (2, [PATTERN, "parallel.tensor=2"]),
    "pp2-memory-on-stage-2": (2, ["model.hybrid_layer_pattern='*-*-|*-*-'", "parallel.pipeline=2"]),
    "dp2-rows": (2, [PATTERN, "parallel.table_sharding=rows"]),
    "full-recompute": (1, [PATTERN, "training.recompute=full"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_gpt_checkpoint_resumes_as_the_hybrid_model_on_the_gpt_curve(small_data, gpt_run, tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    save = resume_at(gpt_run, 2, str(tmp_path / "hybrid"))
    overrides = dict(GPT)
    del overrides["memory.layers"]
    overrides["memory.pattern_layers"] = "[4,6]"  # the pattern's layer numbers of blocks 2 and 3
    proc = run_pretrain(["--config", CONFIG, "--save", save, "--load", save] +
                        small_overrides(small_data, **overrides) + extra, nproc=nproc)
    assert "model.hybrid_layer_pattern: None -> " in proc.stdout and "at iteration 2" in proc.stdout, proc.stdout
    gpt, hybrid = final_curve(gpt_run), final_curve(save)
    steps = [step for step in hybrid if step > 2]
    assert steps == list(range(3, STEPS + 1)), sorted(hybrid)
    limit = 1e-6 if layout in ("1", "full-recompute") else 1e-5
    for index, name in ((0, "lm_loss"), (1, "sparsity_loss")):
        worst = max(abs(hybrid[step][index] - gpt[step][index]) for step in steps)
        assert worst <= limit, (name, worst, {step: (hybrid[step], gpt[step]) for step in steps})


def test_a_memory_layer_that_is_not_an_attention_layer_is_refused_by_name(small_data, tmp_path):
    proc = run_pretrain(["--config", CONFIG, "--save", str(tmp_path / "run")] + small_overrides(
        small_data, **{"memory.pattern_layers": "[1,2]"}) + [PATTERN], check=False)
    assert proc.returncode != 0
    assert ("memory.pattern_layers: layer 1 is '-' (MLP): the memory goes before the attention of an attention "
            "layer. Its attention ('*') layers are [0, 2, 4, 6]") in proc.stderr, proc.stderr[-2000:]
    proc = run_pretrain(["--config", CONFIG, "--save", str(tmp_path / "run")] + small_overrides(small_data) +
                        ["model.hybrid_layer_pattern='*-*-*-'"], check=False)
    assert proc.returncode != 0
    assert "model.num_layers: 4 must count hybrid_layer_pattern '*-*-*-''s attention ('*') layers: 3" in \
        proc.stderr, proc.stderr[-2000:]
