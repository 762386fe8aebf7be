"""Training from table stores (`fe_megatron.tables.store`, `stage_tables`) in runs: bf16 tables, bf16
optimizer state, the host tier, and every table of a bf16 run.

Trained through Megatron (the equivalence script tests/distributed/check_row_sharding.py) fp32 tables
in host memory give the losses, gradient norms, weights and checkpoints of tables held as Megatron's
parameters, at DP=1 and DP=2 with rows; bf16 tables round alike at every layout; fe-pretrain trains
bf16 runs and host-tier runs, resumes them at another size and converts them.  A store in one
process is tests/unit/tables/test_stage_tables.py's; the DeepSpeed engine's stores are tested in
tests/integration/test_deepspeed.py."""

import os

import pytest
import torch

from tests.helpers.torchrun_util import every_check_passed, torchrun
from tests.helpers.training import CONFIG, metrics, resume_at, run_pretrain, small_overrides


# ----------------------------------------------------------------------------- Megatron, library level
def check(reference, *args, nproc: int):
    r = reference
    out = torchrun("check_row_sharding.py", "--init", str(r / "init"), "--steps", "0:3", *args, nproc=nproc)
    every_check_passed(out)


def host_tier_against_the_device_tier(reference, nproc, tables, *extra):
    """fp32 tables in host memory at ``nproc`` ranks against the DP=1 reference on the device."""
    r = reference
    check(r, "--tables", tables, "--placement", "host", "--compare", str(r / "ref_tp1.json"), "--compare-final",
          str(r / "final_tp1"), *extra, nproc=nproc)


@pytest.fixture(scope="module")
def host_rows_step1(reference):
    """The DP=2 row-sharded host-tier run checked against the device tier, and its checkpoint of step 1."""
    checkpoint = reference / "host_rows_step1"
    host_tier_against_the_device_tier(reference, 2, "rows", "--save-step", "1", str(checkpoint))
    return checkpoint


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,tables", [(1, "replicated"), (2, "rows")], ids=["dp1", "dp2-rows"])
def test_the_host_tier_trains_as_the_device_tier(reference, request, nproc, tables):
    """fp32 tables in host memory, each microbatch's rows fetched one microbatch ahead, against the
    same tables held as parameters of Megatron's optimizer on the device (DP=1): losses, gradient
    norms (clipping active) and every weight after 3 Adam steps, within 1e-5."""
    if tables == "rows":  # the run whose step-1 checkpoint the resume below starts from
        assert (request.getfixturevalue("host_rows_step1") / "iter_0000001").is_dir()
    else:
        host_tier_against_the_device_tier(reference, nproc, tables)


@pytest.mark.distributed
def test_a_host_tier_checkpoint_resumes_on_the_device_tier_at_another_size(reference, host_rows_step1):
    """The same checkpoint: a DP=2 row-sharded host-tier run's step-1 checkpoint (tables and Adam
    moments from the table optimizer) resumes at DP=1 with the tables as Megatron's parameters and
    continues as the uninterrupted run."""
    r = reference
    out = torchrun("check_row_sharding.py", "--tables", "replicated", "--load", str(host_rows_step1),
                   "--steps", "1:3", "--compare", str(r / "ref_tp1.json"), "--compare-final", str(r / "final_tp1"),
                   nproc=1)
    every_check_passed(out)


@pytest.mark.distributed
def test_bf16_tables_round_alike_at_every_layout(reference):
    """bf16 tables: the stochastic rounding is a function of each element's global coordinates, so
    DP=2 with rows in host memory ends where DP=1 whole tables on the device end (within fp32's
    differences, 1e-5); both follow the fp32 tables' losses within 1e-3, and so do bf16 moments."""
    r = reference
    check(r, "--tables", "replicated", "--table-dtype", "bf16", "--compare", str(r / "ref_tp1.json"), "--tol", "1e-3",
          "--record", str(r / "bf16.json"), "--save-final", str(r / "bf16_final"), nproc=1)
    check(r, "--tables", "rows", "--placement", "host", "--table-dtype", "bf16", "--compare", str(r / "bf16.json"),
          "--compare-final", str(r / "bf16_final"), nproc=2)
    check(r, "--tables", "rows", "--table-dtype", "bf16", "--state-dtype", "bf16", "--compare",
          str(r / "bf16.json"), "--tol", "1e-3", nproc=2)


# ----------------------------------------------------------------------------- fe-pretrain
def losses(save):
    return [(r["step"], r["lm_loss"]) for r in metrics(save) if "lm_loss" in r]


@pytest.fixture(scope="module")
def fp32_run(small_data, tmp_path_factory):
    """fe-pretrain with whole fp32 tables (DP=1, fp32), checkpoints at 4 and 8: without the distributed optimizer
    trained from stores by the table optimizer's one-pass AdamW (tests/unit/megatron/test_table_optimizer.py: as
    Megatron's Adam trains them as its parameters)."""
    save = str(tmp_path_factory.mktemp("stores") / "fp32")
    proc = run_pretrain(["--config", CONFIG, "--save", save] + small_overrides(small_data))
    assert "tables fp32 in stores on the device, replicated, updated by adamw (every row); in stores because of no " \
           "distributed optimizer: the table optimizer's one-pass AdamW" in proc.stdout
    return save


@pytest.mark.distributed
def test_a_bf16_run_follows_the_fp32_curve_and_resumes_exactly(small_data, fp32_run, tmp_path):
    """training.precision=bf16 (the GPU default) on the CPU: every weight in bf16 as Megatron-LM
    keeps them, the fp32 tables trained from stores; the loss curve stays within 1e-3 of fp32,
    and a resume from step 4 repeats steps 6-8 bit for bit."""
    bf16 = str(tmp_path / "bf16")
    proc = run_pretrain(["--config", CONFIG, "--save", bf16] + small_overrides(small_data, **{"training.precision":
                                                                                                "bf16"}))
    assert "tables fp32 in stores on the device" in proc.stdout
    for (step, fp32), (_, got) in zip(losses(fp32_run), losses(bf16)):
        assert got == pytest.approx(fp32, rel=1e-3), f"step {step}"
    half = resume_at(bf16, 4, str(tmp_path / "resumed"))
    run_pretrain(["--config", CONFIG, "--load", half, "--save", half]
                 + small_overrides(small_data, **{"training.precision": "bf16"}))
    assert losses(half) == losses(bf16)[2:]


@pytest.mark.distributed
def test_a_resume_may_change_the_table_storage_except_across_the_distributed_optimizer(small_data, fp32_run,
                                                                                        tmp_path):
    """The tables' state has the same names however they are kept: fp32 tables resume as bf16 tables with bf16
    state in host memory (cast as they load) and follow the fp32 curve; fp32 tables held by Megatron's
    distributed optimizer, whose layout differs, refuse the change by name. (Tables held by Megatron's optimizer
    without it resume from stores: test_table_checkpoints.py's megatron_replicated checkpoint.)"""
    storage = {"memory.table_dtype": "bf16", "optimizer.table_state_dtype": "bf16", "memory.table_placement": "host"}
    half = resume_at(fp32_run, 4, str(tmp_path / "changed"))
    proc = run_pretrain(["--config", CONFIG, "--load", half, "--save", half] + small_overrides(small_data, **storage))
    assert "changed since the checkpoint: memory.table_placement: 'device' -> 'host'" in proc.stdout
    for (step, got), (_, expected) in zip(losses(half), losses(fp32_run)[2:]):
        assert got == pytest.approx(expected, rel=1e-3), f"step {step}"
    distributed = {"parallel.distributed_optimizer": "true", "training.train_steps": 2, "training.save_interval": 2,
                   "optimizer.warmup_steps": 1}
    source = str(tmp_path / "distributed")
    run_pretrain(["--config", CONFIG, "--save", source] + small_overrides(small_data, **distributed))
    refused = run_pretrain(["--config", CONFIG, "--load", source, "--save", source]
                           + small_overrides(small_data, **dict(distributed, **storage, **{"training.train_steps": 4})),
                           check=False)
    assert refused.returncode != 0
    assert "trained its tables as Megatron's parameters" in refused.stderr
    assert "with parallel.distributed_optimizer the two keep the tables' Adam moments in layouts" in refused.stderr


@pytest.mark.distributed
def test_bf16_tables_in_host_memory_train_resume_at_another_size_and_convert(small_data, tmp_path):
    """fe-pretrain at DP=2 with bf16 tables, bf16 state, rows, in host memory; its step-4 checkpoint
    resumes on one rank and follows the 2-rank run; fe-convert keeps the trained bf16 tables."""
    from fe_megatron.convert.to_hf import mcore_to_hf
    from fe_megatron.hf import FactorEngramForCausalLM

    storage = {"memory.table_dtype": "bf16", "optimizer.table_state_dtype": "bf16",
               "memory.table_placement": "host", "parallel.table_sharding": "rows"}
    save = str(tmp_path / "run")
    proc = run_pretrain(["--config", CONFIG, "--save", save] + small_overrides(small_data, **storage), nproc=2)
    assert "tables bf16 (state bf16) in stores in host memory, rows" in proc.stdout
    curve = losses(save)
    assert all(abs(lm) < 10 for _, lm in curve) and curve[-1][1] < curve[0][1]
    half = resume_at(save, 4, str(tmp_path / "one_rank"))
    run_pretrain(["--config", CONFIG, "--load", half, "--save", half] + small_overrides(small_data, **storage))
    for (step, got), (_, expected) in zip(losses(half), curve[2:]):
        assert got == pytest.approx(expected, rel=1e-3), f"step {step}"
    model = FactorEngramForCausalLM.from_pretrained(mcore_to_hf(save, str(tmp_path / "hf"))).eval()
    assert model.config.memory["table_dtype"] == "bf16" and model.config.memory["table_placement"] == "device"
    assert model.model.layers[model.config.memory["layers"][0]].memory.tables.weight.dtype == torch.bfloat16


@pytest.mark.distributed
def test_a_pipeline_stage_without_memory_trains_and_resumes_exactly(small_data, tmp_path):
    """PP=2 with memory at layers 2 and 3 only (stage 0 holds none, as the paper's layers 10 and 12
    do at PP=4): every stage keeps a table member in its optimizer chain, and the step-4
    checkpoint, whose common part stage 0 writes, resumes steps 6-8 bit for bit."""
    layout = {"parallel.pipeline": 2, "memory.layers": "[2, 3]"}
    save = str(tmp_path / "run")
    proc = run_pretrain(["--config", CONFIG, "--save", save] + small_overrides(small_data, **layout), nproc=2)
    assert "tables fp32 in stores on the device" in proc.stdout
    half = resume_at(save, 4, str(tmp_path / "resumed"))
    run_pretrain(["--config", CONFIG, "--load", half, "--save", half] + small_overrides(small_data, **layout), nproc=2)
    assert losses(half) == losses(save)[2:]
