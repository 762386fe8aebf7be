"""fe-eval and fe-inspect on a trained run directory: the run evaluates like its conversion, in one
process or two under torchrun, and fe-inspect reports every insertion layer."""

import json
import os
import subprocess
import sys

import pytest

from fe_megatron.evaluation.cli import main as fe_eval
from tests.helpers.evaluation import write_jsonl
from tests.helpers.training import CONFIG, ENDS_CLEANLY, ROOT, run_pretrain, small_overrides


@pytest.fixture(scope="module")
def trained_run(small_data, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("eval") / "run")
    run_pretrain(["--config", CONFIG, "--save", run] + small_overrides(
        small_data, **{"training.train_steps": 4, "training.save_interval": 4, "optimizer.warmup_steps": 1,
                       "training.eval_interval": 4, "optimizer.lr": 1e-2}))
    return run


def test_a_run_directory_evaluates_like_its_conversion_in_one_process_or_two(trained_run, tmp_path, capfd):
    from fe_megatron.convert.to_hf import mcore_to_hf

    run = trained_run
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": line} for line in [
        "Fellow citizens of the Senate and of the House of Representatives.",
        "The state of the Union is strong, and our economy grows.", "We must do more.", "Thank you."]])
    outputs = {}
    for name, load in (("run", run), ("hf", mcore_to_hf(run, str(tmp_path / "hf")))):
        assert fe_eval(["ppl", "--load", load, "--data", text, "--stride", "32", "--output",
                        str(tmp_path / f"{name}.json")]) == 0
        outputs[name] = json.load(open(tmp_path / f"{name}.json"))["results"][0]
    assert outputs["run"]["token_ppl"] == pytest.approx(outputs["hf"]["token_ppl"], rel=1e-6)
    long_text = write_jsonl(tmp_path / "long.jsonl", [{"text": " ".join(["We must do more for the Union."] * 60)}])
    capfd.readouterr()
    assert fe_eval(["ppl", "--load", str(tmp_path / "hf"), "--data", long_text, "--output",
                    str(tmp_path / "long.json")]) == 0
    assert "Token indices sequence length" not in capfd.readouterr().err  # fe-eval windows the text itself
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    # through ends_cleanly.py: fe-eval ends the gloo group it started, so no thread of it is left to Python's exit
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           ENDS_CLEANLY, "--entry", "fe_megatron.evaluation.cli", "ppl", "--load", run, "--data", text,
                           "--stride", "32", "--output", str(tmp_path / "two.json")], capture_output=True, text=True,
                          cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    two = json.load(open(tmp_path / "two.json"))["results"][0]
    assert two["tokens"] == outputs["run"]["tokens"] and two["documents"] == 4
    assert two["token_ppl"] == pytest.approx(outputs["run"]["token_ppl"], rel=1e-7)  # sums in another order


def test_inspect_reports_every_insertion_layer(trained_run, small_data, tmp_path):
    from fe_megatron.evaluation.inspect import main as fe_inspect

    out = tmp_path / "inspect"
    assert fe_inspect(["--load", trained_run, "--data", small_data["subset"], "--max-tokens", "2000",
                       "--output", str(out)]) == 0
    summary = json.load(open(out / "summary.json"))
    assert sorted(summary) == ["1", "2"]  # factorengram-tiny's layers
    layer = summary["1"]
    assert len(layer["basis_usage"]) == 192 and 0.0 < layer["mean_active"] < 1.0
    assert 0.0 < layer["z_below_threshold"] < 1.0
    assert sorted(layer["gates_by_order"]) == ["1", "2", "3"]
    assert all(0.0 < g["mean"] < 1.0 for g in layer["gates_by_order"].values())
    assert sorted(layer["collisions"], key=int) == ["2", "3", "4", "5"]  # the hashed (bigram, trigram) branches
    assert all(c["distinct_ngrams"] > 100 for c in layer["collisions"].values())
    assert (out / "basis_usage.png").is_file() and (out / "gates_by_order.png").is_file()
    # threshold 0: nothing is below it, every coefficient is active everywhere
    assert fe_inspect(["--load", trained_run, "--data", small_data["subset"], "--max-tokens", "300",
                       "--threshold", "0", "--output", str(tmp_path / "zero")]) == 0
    zero = json.load(open(tmp_path / "zero" / "summary.json"))["2"]
    assert zero["z_below_threshold"] == 0.0 and zero["never_active"] == 0 and zero["mean_active"] == 1.0
