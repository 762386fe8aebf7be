"""Tables sharded by rows over the data-parallel ranks (parallel.table_sharding: rows)."""

import os

import pytest

from tests.helpers.torchrun_util import every_check_passed, torchrun


@pytest.fixture(scope="module")
def rows_step1(reference):
    """DP=2 with sharded tables against DP=1 with whole ones on the same global batches (its output),
    and its checkpoint of step 1, which the resumes in other layouts start from."""
    r = reference
    out = torchrun("check_row_sharding.py", "--tables", "rows", "--init", str(r / "init"), "--steps", "0:3",
                   "--compare", str(r / "ref_tp1.json"), "--compare-final", str(r / "final_tp1"), "--save-step",
                   "1", str(r / "rows_step1"), "--check-memory")
    return out, r / "rows_step1"


@pytest.mark.distributed
def test_dp2_rows_match_dp1_whole_tables_and_hold_half_of_them(rows_step1):
    """DP=2 with sharded tables against DP=1 with whole ones on the same global batches: losses,
    gradient norms and every parameter after 3 Adam steps; then a checkpoint of step 1."""
    out, checkpoint = rows_step1
    every_check_passed(out)
    assert (checkpoint / "iter_0000001").is_dir()


@pytest.mark.distributed
def test_dp2_tp2_rows_match_dp1_tp2_whole_tables(reference):
    r = reference
    out = torchrun("check_row_sharding.py", "--tables", "rows", "--tp", "2", "--init", str(r / "init"),
                   "--steps", "0:3", "--compare", str(r / "ref_tp2.json"), "--compare-final", str(r / "final_tp2"),
                   "--check-memory", nproc=4)
    every_check_passed(out)


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, extra", [(4, ["--pp", "2"]), (2, ["--recompute"])], ids=["pp2-dp2", "recompute"])
def test_rows_under_pipeline_parallelism_and_recompute(reference, nproc, extra):
    """Row-sharded tables on a two-stage pipeline (each stage its own memory-parallel group), and
    under full activation recompute (the exchange runs again in the recomputation)."""
    r = reference
    out = torchrun("check_row_sharding.py", "--tables", "rows", *extra, "--init", str(r / "init"), "--steps", "0:3",
                   "--compare", str(r / "ref_tp1.json"), "--compare-final", str(r / "final_tp1"), "--check-memory",
                   nproc=nproc)
    every_check_passed(out)


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, tables, tp", [(1, "rows", 1), (1, "replicated", 1), (2, "replicated", 1),
                                               (4, "rows", 2)],
                         ids=["dp1", "dp1-replicated", "dp2-replicated", "dp2-tp2"])
def test_rows_checkpoint_resumes_in_other_layouts(reference, rows_step1, nproc, tables, tp):
    """A DP=2 row-sharded checkpoint (model, Adam state, schedule) continues exactly in another layout."""
    r, (_, checkpoint) = reference, rows_step1
    # against the uninterrupted run that wrote the checkpoint (TP=1): its steps 1 and 2
    out = torchrun("check_row_sharding.py", "--tables", tables, "--tp", str(tp), "--load", str(checkpoint),
                   "--steps", "1:3", "--compare", str(r / "ref_tp1.json"), "--compare-final", str(r / "final_tp1"),
                   nproc=nproc)
    every_check_passed(out)


@pytest.mark.distributed
def test_node_shared_tables_resume_from_row_sharded_ones_match_dp1_and_resume_as_whole(reference, rows_step1,
                                                                                      tmp_path):
    """The DP=2 row-sharded checkpoint of step 1 continues with node-shared host tables (one segment for the
    node, each rank's rows a slice of it) on DP=1's curve with whole tables: losses, gradient norms and every
    parameter after steps 1 and 2 (one with many repeated rows, one with none); their checkpoint of step 2
    continues at DP=1 with whole tables."""
    r, (_, rows_checkpoint) = reference, rows_step1
    compare = ("--compare", str(r / "ref_tp1.json"), "--compare-final", str(r / "final_tp1"))
    out = torchrun("check_row_sharding.py", "--tables", "node", "--placement", "host", "--load", str(rows_checkpoint),
                   "--steps", "1:3", *compare, "--save-step", "2", str(tmp_path / "node_step2"), "--check-memory",
                   nproc=2)
    every_check_passed(out)
    out = torchrun("check_row_sharding.py", "--tables", "replicated", "--load", str(tmp_path / "node_step2"),
                   "--steps", "2:3", *compare, nproc=1)
    every_check_passed(out)


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_stage_s_layers_share_one_exchange(nproc):
    """Three layers' lookups in one `StageRowExchange`: the rows and every shard's gradient equal the
    whole tables' (plain parameters, DDP's main_grad and stores), with 3 all-to-alls in forward and
    one in backward for all of them."""
    out = torchrun("check_stage_exchange.py", nproc=nproc)
    every_check_passed(out)


@pytest.mark.distributed
def test_an_expert_parallel_moe_backbone_trains_beside_row_sharded_tables(small_data, tmp_path, capsys):
    """The tables' row group is their own: with 4 experts over 2 expert-parallel ranks (DP=2), tables
    sharded by rows over both ranks train as whole tables do, step for step, and a row-sharded
    checkpoint resumes with whole tables."""
    import shutil

    from tests.helpers.training import CONFIG, final_curve, run_pretrain, small_overrides

    moe = small_overrides(small_data, **{"model.num_experts": 4, "model.moe_router_topk": 2, "parallel.expert": 2,
                                         "training.train_steps": 4, "training.save_interval": 2,
                                         "training.eval_interval": 2, "training.log_interval": 1})
    runs = {}
    for tables in ("rows", "replicated"):
        runs[tables] = str(tmp_path / tables)
        proc = run_pretrain(["--config", CONFIG, "--save", runs[tables], f"parallel.table_sharding={tables}"] + moe,
                            nproc=2)
        assert "in stores because of " in proc.stdout and "an expert-parallel backbone" in proc.stdout
        runs[tables + "_stdout"] = proc.stdout
    # every expert counted once, as fe-plan's budget counts them
    import re

    from fe_megatron.planning.budget import total_params
    from fe_megatron.training.config import load_train_config

    counted = int(re.search(r"model factorengram: ([\d,]+) parameters", runs["rows_stdout"]).group(1).replace(",", ""))
    assert counted == total_params(load_train_config(CONFIG, moe).memory)
    rows, whole = final_curve(runs["rows"]), final_curve(runs["replicated"])
    assert set(rows) == set(whole) == {1, 2, 3, 4}
    for step in rows:
        assert rows[step] == pytest.approx(whole[step], rel=1e-5), step
    assert rows[4][0] < rows[1][0]  # the language-model loss falls
    resumed = str(tmp_path / "resumed")
    shutil.copytree(runs["rows"], resumed)
    shutil.rmtree(os.path.join(resumed, "iter_0000004"))
    os.remove(os.path.join(resumed, "metrics.jsonl"))  # what the resumed run logs, alone
    with open(os.path.join(resumed, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("2")
    proc = run_pretrain(["--config", CONFIG, "--save", resumed, "--load", resumed,
                         "parallel.table_sharding=replicated"] + moe, nproc=2)
    assert "at iteration 2" in proc.stdout
    again = final_curve(resumed)
    for step in (3, 4):
        assert again[step] == pytest.approx(rows[step], rel=1e-5), step
    # the Hugging Face model's FFN is dense: conversion and fe-eval refuse the experts by name
    from fe_megatron.convert.cli import main as fe_convert
    from fe_megatron.evaluation.cli import main as fe_eval

    capsys.readouterr()
    assert fe_convert(["mcore-to-hf", "--load", runs["rows"], "--output", str(tmp_path / "hf")]) != 0
    assert fe_eval(["ppl", "--load", runs["rows"], "--data", small_data["subset"]]) != 0
    assert capsys.readouterr().err.count("4 experts per layer (model.num_experts)") == 2
    assert not (tmp_path / "hf").exists()


@pytest.mark.distributed
@pytest.mark.skipif(not __import__("fe_megatron.megatron.compat", fromlist=["compat"]).has_hybrid_model(),
                    reason="megatron-core has no HybridModel here (0.19 on); `make test-newest` runs this test")
def test_the_hybrid_model_s_rows_at_dp2_match_its_whole_tables_at_dp1(tmp_path):
    """The hybrid model with memory (a '*-' pair per GPT layer) at DP=2 with tables row-sharded in stores
    against DP=1 with whole fp32 tables as parameters: the same losses, gradient norms and parameters
    after 3 Adam steps, within 1e-5."""
    torchrun("check_row_sharding.py", "--model", "hybrid", "--tables", "replicated", "--save-init",
             str(tmp_path / "init"), "--steps", "0:3", "--record", str(tmp_path / "ref.json"), "--save-final",
             str(tmp_path / "final"), nproc=1)
    out = torchrun("check_row_sharding.py", "--model", "hybrid", "--tables", "rows", "--init", str(tmp_path / "init"),
                   "--steps", "0:3", "--compare", str(tmp_path / "ref.json"), "--compare-final",
                   str(tmp_path / "final"))
    every_check_passed(out)
