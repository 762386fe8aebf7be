"""Sparse table updates across parallel layouts and checkpoints, through Megatron's optimizer chain
(tests/distributed/check_row_sharding.py against the DP=1 reference)."""

import pytest

from tests.helpers.torchrun_util import every_check_passed, torchrun


def check_sharding(*args, nproc: int):
    out = torchrun("check_row_sharding.py", *args, nproc=nproc)
    every_check_passed(out)


# TP=2 against TP=1: the two split the dense layers' matrix products differently and so round
# differently, and Adam's per-element normalization carries that rounding into the weights (SGD does
# not: tests/distributed/check_gpt_parallel.py compares TP=2 with TP=1 within 1e-5).  After two Adam
# steps a dense weight differed by 1.425e-05 relative on a 2-core Xeon (2026-11-29), every run alike;
# every comparison within one tensor-parallel size keeps 1e-5.
ACROSS_TP = ("--tol", "5e-5")


@pytest.mark.distributed
@pytest.mark.parametrize("rule, per_row", [("rowwise_adagrad", "momentum"), ("partial_rowwise_adam", "exp_avg_sq")])
def test_a_row_wise_rule_trains_alike_at_every_layout_and_resumes_across_them(reference, tmp_path, rule, per_row):
    """Through Megatron's optimizer chain (clipping by one global norm, the scheduler's learning
    rate): whole tables at DP=1 against DP=2 row shards, DP=2 replicas (their touched rows' union
    all-reduced) and TP=2 (a row's squares summed over its columns), and the step-1 checkpoints resumed at
    DP=1: losses, gradient norms and every weight within 1e-5.  The replicas, node-shared host tables and
    TP=2 run for ``rowwise_adagrad`` only: what they exercise (the row union, `SparseTableOptimizer.row_mean_square`,
    the per-row state's TP replicas in `fe_megatron.megatron.table_shards.replica_ids`) is the same code for
    every row-wise rule.  The rule's per-row state is checkpointed by global
    row, one value per row (its registry entry's keys)."""
    init, record, final = str(reference / "init"), str(tmp_path / "dp1.json"), str(tmp_path / "dp1_final")
    update = ("--table-update", rule)
    check_sharding("--tables", "replicated", *update, "--init", init, "--steps", "0:3", "--record", record,
                   "--save-final", final, nproc=1)
    compare = ("--compare", record, "--compare-final", final)
    if rule == "rowwise_adagrad":
        check_sharding("--tables", "replicated", *update, "--init", init, "--steps", "0:3", *compare, nproc=2)
    check_sharding("--tables", "rows", *update, "--init", init, "--steps", "0:3", *compare, "--save-step", "1",
                   str(tmp_path / "rows_step1"), nproc=2)
    if rule == "rowwise_adagrad":  # node-shared host tables: the rows in the node's shared segment, the state
        # with each row's owner (the same owners' code for every rule)
        check_sharding("--tables", "node", "--placement", "host", *update, "--init", init, "--steps", "0:3", *compare,
                       nproc=2)
    # the per-row state is saved as one value per row, [table rows, 1], at every layout
    from fe_megatron.convert.megatron_reader import DistCheckpoint

    saved = DistCheckpoint(str(tmp_path / "rows_step1" / "iter_0000001")).metadata
    tables = {name: tuple(meta.size) for name, meta in saved.items() if name.endswith("memory.tables.weight")
              and not name.startswith("optimizer.")}
    assert tables and not any(f"optimizer.state.{per_row}.{name}" in saved for name in tables)
    for name, (rows, width) in tables.items():
        assert tuple(saved[f"optimizer.state.row_{per_row}.{name}"].size) == (rows, 1)
        if rule == "partial_rowwise_adam":  # its first moment, per parameter, sharded as the table
            assert tuple(saved[f"optimizer.state.exp_avg.{name}"].size) == (rows, width)
    resumed = {"rows_step1": ()}
    if rule == "rowwise_adagrad":  # TP=2's per-row state is the rules' shared code (table_shards)
        check_sharding("--tables", "replicated", "--tp", "2", *update, "--init", init, "--steps", "0:3", *compare,
                       "--save-step", "1", str(tmp_path / "tp2_step1"), *ACROSS_TP, nproc=2)
        resumed["tp2_step1"] = ACROSS_TP
    for saved, tolerance in resumed.items():  # both reshard to whole tables on one rank
        check_sharding("--tables", "replicated", *update, "--load", str(tmp_path / saved), "--steps", "1:3",
                       *compare, *tolerance, nproc=1)


@pytest.mark.distributed
def test_lazy_adam_in_host_memory_trains_as_on_the_device_and_resumes(reference, tmp_path):
    init, record, final = str(reference / "init"), str(tmp_path / "dp1.json"), str(tmp_path / "dp1_final")
    update = ("--table-update", "lazy_adam")
    check_sharding("--tables", "replicated", *update, "--init", init, "--steps", "0:3", "--record", record,
                   "--save-final", final, nproc=1)
    compare = ("--compare", record, "--compare-final", final)
    # node-shared host tables: the row-sharded ones, each node's rows once in shared memory
    check_sharding("--tables", "node", "--placement", "host", *update, "--init", init, "--steps", "0:3", *compare,
                   "--save-step", "1", str(tmp_path / "node_step1"), nproc=2)
    check_sharding("--tables", "replicated", *update, "--load", str(tmp_path / "node_step1"), "--steps", "1:3",
                   *compare, nproc=1)
