"""Checkpoints written by an earlier main, one per engine and table mode, still load and resume:
`tests/data/checkpoints_2026_11` holds each run's step-2 checkpoint and the values that run logged
at steps 3 and 4, which the resumed run must log again.  They guard the tables' on-disk formats
(whole and row-sharded tables, bf16 tables and their state in stores, the host tier, ZeRO-3
partitions and DeepSpeed's row-sharded tables) across changes of the code that trains them."""

import json
import os
import shutil

import pytest

from tests.helpers.paths import TEST_DATA
from tests.helpers.training import CONFIG, final_curve, run_pretrain

DATA = os.path.join(TEST_DATA, "checkpoints_2026_11")
with open(os.path.join(DATA, "expected.json")) as _fh:
    EXPECTED = json.load(_fh)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The bundled corpus tokenized with the checkpoints' own tokenizer, as make_checkpoints.py made it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_checkpoints", os.path.join(DATA, "make_checkpoints.py"))
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    return maker, maker.make_data(str(tmp_path_factory.mktemp("corpus")))


@pytest.mark.parametrize("mode", [pytest.param(mode, marks=[pytest.mark.distributed] if spec["processes"] > 1 else [])
                                  for mode, spec in EXPECTED["modes"].items()])
def test_a_checkpoint_of_an_earlier_main_resumes_and_logs_its_values_again(corpus, mode, tmp_path):
    maker, data = corpus
    spec = EXPECTED["modes"][mode]
    if "deepspeed" in mode:
        pytest.importorskip("deepspeed", reason="DeepSpeed is installed by the project's set-up (make setup)")
    run = tmp_path / mode
    shutil.copytree(os.path.join(DATA, mode), run)
    proc = run_pretrain(["--config", CONFIG, "--load", str(run), "--save", str(run)] + maker.overrides(mode, data),
                        nproc=spec["processes"], ends_cleanly=True)
    assert f"at iteration {maker.SAVED_STEP}" in proc.stdout
    got = final_curve(str(run))
    for step, values in spec["steps"].items():
        logged = dict(zip(("lm_loss", "sparsity_loss", "val_loss"), (got[int(step)].get(i) for i in range(3))))
        for name, value in values.items():
            assert logged[name] == pytest.approx(value, rel=1e-5), f"{mode}, step {step}: {name}"
