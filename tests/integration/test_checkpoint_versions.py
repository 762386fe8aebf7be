"""Checkpoints across megatron-core releases (docs/compatibility.md).

* A run saved under megatron-core 0.16.1 resumes under 0.19 and continues the curve it would have
  followed.
* The other way cannot work: 0.19's dist_checkpointing keeps a checkpoint's common state inside
  its torch_dist files, and 0.16.1 reads it only from ``common.pt``.  fe-pretrain refuses
  such a checkpoint by name, before building anything.  The weights still carry over: ``fe-convert
  mcore-to-hf`` under the newer release, then ``hf-to-mcore`` under the older one.

Needs a second stack's Python: ``FE_OTHER_STACK_PYTHON``, which ``make test-newest`` sets to the
oldest stack's ``.venv/bin/python`` while this process runs the newest.
"""

import os
import subprocess
import sys

import pytest

from tests.helpers.training import CONFIG, ROOT, curve, metrics, run_pretrain, small_overrides

OTHER_PYTHON = os.environ.get("FE_OTHER_STACK_PYTHON")
pytestmark = pytest.mark.skipif(
    not OTHER_PYTHON or not os.path.exists(OTHER_PYTHON),
    reason="FE_OTHER_STACK_PYTHON names no second stack's python; `make test-newest` sets it to the oldest "
           "stack's .venv/bin/python (run `make setup` first)")
# The same weights and batches after the resume; torch releases may order a float reduction differently.
RELATIVE_TOLERANCE = 1e-5


def megatron_core_version(python: str) -> tuple:
    code = "from importlib.metadata import version; print(version('megatron-core'))"
    text = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in text.split("+")[0].split(".")[:3])


@pytest.fixture(scope="module")
def stacks():
    """(older python, newer python) by their megatron-core releases."""
    pythons = sorted([OTHER_PYTHON, sys.executable], key=megatron_core_version)
    assert megatron_core_version(pythons[0]) < megatron_core_version(pythons[1]), "both run one megatron-core"
    return pythons


def _half_run(small_data, tmp_path, writer):
    """The full 8-step run and the same run stopped after its step-4 checkpoint, both by ``writer``."""
    args = small_overrides(small_data, **{"parallel.distributed_optimizer": "true"})
    full, half = str(tmp_path / "full"), str(tmp_path / "half")
    run_pretrain(["--config", CONFIG, "--save", full] + args, python=writer)
    run_pretrain(["--config", CONFIG, "--save", half] + args + ["training.exit_after=4"], python=writer)
    return args, full, half


def test_a_checkpoint_of_the_oldest_release_resumes_under_the_newest(small_data, tmp_path, stacks):
    older, newer = stacks
    args, full, half = _half_run(small_data, tmp_path, older)
    resumed = run_pretrain(["--config", CONFIG, "--save", half, "--load", half] + args, python=newer)
    assert "at iteration 4" in resumed.stdout, resumed.stdout[-2000:]
    expected = [row for row in curve(metrics(full)) if row[0] > 4]
    after = [row for row in curve(metrics(half)) if row[0] > 4]
    assert [row[0] for row in after] == [row[0] for row in expected] == [6, 8, 8]  # step 8's training and validation rows
    for got, want in zip(after, expected):
        for value, reference in zip(got[1:], want[1:]):
            assert (value is None) == (reference is None), (got, want)
            if reference is not None:
                assert value == pytest.approx(reference, rel=RELATIVE_TOLERANCE), (got, want)


def test_a_checkpoint_of_the_newest_release_is_refused_by_the_oldest_by_name_and_still_converts(
        small_data, tmp_path, stacks):
    older, newer = stacks
    args, _, half = _half_run(small_data, tmp_path, newer)
    refused = run_pretrain(["--config", CONFIG, "--save", half, "--load", half] + args, python=older, check=False)
    assert refused.returncode != 0
    message = refused.stdout + refused.stderr
    assert "which keeps a checkpoint's common state inside its torch_dist files" in message, message[-3000:]
    assert "megatron-core 0.19" in message and "fe-convert mcore-to-hf" in message
    assert "Traceback" not in message, message[-3000:]
    assert sorted(os.listdir(half)) == ["iter_0000004", "latest_checkpointed_iteration.txt", "metrics.jsonl"]
    # the weights carry over: converted under the release that wrote them, read back under the older one
    hf, carried = str(tmp_path / "hf"), str(tmp_path / "carried")
    for python, command in ((newer, ["mcore-to-hf", "--load", half, "--output", hf]),
                            (older, ["hf-to-mcore", "--input", hf, "--output", carried])):
        converted = subprocess.run([python, "-m", "fe_megatron.convert", *command], capture_output=True, text=True,
                                   cwd=ROOT)
        assert converted.returncode == 0, converted.stdout[-2000:] + converted.stderr[-2000:]
    started = run_pretrain(["--config", CONFIG, "--save", str(tmp_path / "continued"), "--load", carried] + args +
                           ["training.train_steps=3"], python=older)
    assert "(a converted checkpoint: no optimizer state)" in started.stdout, started.stdout[-2000:]
