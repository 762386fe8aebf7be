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


def test_deepspeed_table_files_of_an_earlier_main_are_read_by_global_row():
    """A DeepSpeed checkpoint written before the tables' checkpoint of every engine holds one
    ``tables_rank_*.pt`` per rank; fe-eval (and with it fe-inspect and fe-convert deepspeed-to-hf,
    which read through the same `DeepSpeedWeights`) reads them into whole tables, each rank's rows
    at the global rows its row partition names."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is installed by the project's set-up (make setup)")
    import torch

    from fe_megatron.checkpoint.reader import configs_of
    from fe_megatron.checkpoint.files import read_run_info
    from fe_megatron.evaluation.model import EvalModel
    from fe_megatron.ngram import NgramHasher
    from fe_megatron.tables.row_exchange import RowPartition

    run = os.path.join(DATA, "deepspeed_rows")
    folder = os.path.join(run, "iter_0000002")
    _, memory = configs_of(read_run_info(folder))
    model = EvalModel.load(run, tokenizer=os.path.join(DATA, "tokenizer.model")).model
    shards = [torch.load(os.path.join(folder, f"tables_rank_{rank:05d}.pt"), weights_only=True)["tables"]
              for rank in range(2)]
    for layer in memory.layers:
        name = f"model.layers.{layer}.memory.tables.weight"
        whole = model.state_dict()[name]
        layout = NgramHasher(memory, layer).layouts[0]
        assert whole.shape[0] == sum(layout.moduli) and whole.shape[0] > shards[0][name].shape[0]
        for rank, shard in enumerate(shards):
            for first, rows, local in RowPartition(layout.moduli, layout.offsets, 2, rank).slices():
                assert torch.equal(whole[first:first + rows], shard[name][local:local + rows]), (name, rank, first)
