"""The GPU tier's own machinery, on any machine: `make gpu-check` without a GPU says so and runs nothing,
and the check's time budget ends a command with its children. (Not marked ``gpu``: `make test` runs these.)"""

import os
import subprocess
import sys
import time

import pytest

from tests.gpu import check


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU: make gpu-check runs")
def test_gpu_check_without_a_gpu_says_so_and_runs_nothing(tmp_path):
    out = tmp_path / "gpu_results"
    proc = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={sys.executable}", f"GPU_RESULTS={out}"],
                          cwd=check.ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no GPU is visible" in proc.stderr and "nothing was run" in proc.stderr and "gpu-check-dry" in proc.stderr
    assert not out.exists()


def test_gpu_check_budget_ends_commands_with_their_children_and_refuses_to_start_late(tmp_path, monkeypatch):
    """A command outliving what is left of the budget is killed with the processes it started (its own
    session), and a command with too little left is not started (BudgetSpent)."""
    monkeypatch.setattr(check, "MIN_COMMAND_S", 1)
    checker = check.Checker(str(tmp_path), budget_s=3)
    marker = tmp_path / "child_survived"
    # the shell starts a child that would write the marker after 6 s, then waits for it
    script = f"(sleep 6; touch {marker}) & wait"
    start = time.monotonic()
    rc, output = checker.run("sleeper", ["bash", "-c", script], timeout=600)
    assert rc == 124 and "timed out after" in output and time.monotonic() - start < 5
    with pytest.raises(check.BudgetSpent):
        checker.run("late", [sys.executable, "-c", "print('ran')"], timeout=600)
    assert "not run: the time budget is spent" in (tmp_path / "logs" / "late.log").read_text()
    time.sleep(4)
    assert not marker.exists(), "the command's child outlived the timeout"
    curve = tmp_path / "metrics.jsonl"
    curve.write_text('{"step": 10, "lm_loss": 6.5}\n{"step": 20, "lm_lo')  # a run stopped mid-write
    assert check.lm_curve(str(tmp_path)) == {10: 6.5}


def test_the_results_file_records_every_step_and_the_summary_names_a_dry_run(tmp_path):
    checker = check.Checker(str(tmp_path), dry=True)
    checker.record("build", True, 1.0, {"backends": "cpp"})
    checker.record("pretrain", False, 2.0, why="runs that failed: gpu_bf16")
    checker.not_run("kernel-bench", "the time budget was spent before it ended")
    import json

    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["dry_run"] is True
    assert [(s["step"], s["status"]) for s in written["steps"]] == [
        ("build", "pass"), ("pretrain", "FAIL"), ("kernel-bench", "not run")]
    summary = (tmp_path / "gpu_check.md").read_text()
    assert "dry run on CPU" in summary and "runs that failed: gpu_bf16" in summary
    assert os.path.isfile(tmp_path / "gpu_check.md")


def test_a_step_cut_off_from_outside_leaves_what_its_runs_measured(tmp_path):
    """A step of several runs writes each run's numbers as it ends (status ``running``): a lease that ends mid-step
    leaves them in the results file; the step's record replaces them, and a budget spent mid-step keeps them in
    its reason."""
    import json

    checker = check.Checker(str(tmp_path), dry=True)
    checker.record("environment", True, 1.0)
    checker.progress("method", {"final_lm_loss": {"factorengram": 5.1}})
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["step"], s["status"]) for s in written["steps"]] == [("environment", "pass"), ("method", "running")]
    assert written["steps"][1]["numbers"] == {"final_lm_loss": {"factorengram": 5.1}}
    assert "running" in (tmp_path / "gpu_check.md").read_text()
    checker.not_run("method", "the time budget was spent before it ended")
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["status"] for s in written["steps"]] == ["pass", "not run"]
    assert '"factorengram": 5.1' in written["steps"][1]["why"] and not list(tmp_path.glob("*.tmp"))
