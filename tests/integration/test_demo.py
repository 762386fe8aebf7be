"""fe-demo's short run: a few steps of both models, the warm-up scaled to them, TensorBoard started clean,
and the paired throughput table."""

import json
import os

from tests.helpers.commands import BIN, command, run


def test_fe_demo_with_few_steps_scales_warmup_and_starts_tensorboard_clean(tmp_path):
    stale = tmp_path / "tensorboard" / "factorengram"
    stale.mkdir(parents=True)
    (stale / "events.out.tfevents.stale").write_text("old run")
    proc = run(command("fe-demo") + ["--steps", "3", "--paired-steps", "2", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-2000:]
    assert "optimizer.warmup_steps=0" in proc.stdout
    assert not (stale / "events.out.tfevents.stale").exists() and len(os.listdir(stale)) == 1
    assert "model            val ppl  test ppl    parameters   tokens/s" in proc.stdout
    # the tokens/s come from one process that alternated one step of each model, after training
    throughput = json.loads((tmp_path / "throughput.json").read_text())
    assert throughput["method"] == "paired" and throughput["steps_per_model"] == 2
    assert [len(throughput["step_seconds"][kind]) for kind in ("factorengram", "transformer")] == [2, 2]
    assert "(tokens/s: the median step of 2 training steps of each model after training, alternating one step of " \
           "each in one process, so both ran under the same load; factorengram / transformer = " in proc.stdout
    assert f"TensorBoard: {os.path.join(BIN, 'tensorboard')} --logdir {tmp_path / 'tensorboard'}" in proc.stdout
