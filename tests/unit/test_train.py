"""fe-pretrain's entry (`fe_megatron.train`): the kernel backend it accepts for the tables' device, and a
two-step Megatron-engine run in the test process, after which torch and megatron-core are as they were
(also after a run that fails). The arguments it asks for, overrides between the options and --check, as a
user runs the command, are tests/integration/test_commands.py's."""

import pytest
import torch


def test_forced_kernel_backend_must_take_the_tables_device():
    from fe_megatron.train import check_kernel_backend

    check_kernel_backend("cpp", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"kernel backend 'cpp' runs on cpu tensors, but this run's tables are on "
                                         r"cuda; use kernel_backend=auto or one of \['torch'"):
        check_kernel_backend("cpp", torch.device("cuda"))


# fe-pretrain at its smallest: two steps of a 2-layer model on 32 tokens, one validation, no checkpoint
TINY_RUN = {"training.train_steps": 2, "training.log_interval": 1, "training.eval_interval": 2,
            "training.eval_steps": 1, "training.save_interval": 0, "training.micro_batch_size": 1,
            "training.global_batch_size": 2, "optimizer.warmup_steps": 1, "model.seq_length": 32,
            "model.num_layers": 2, "model.hidden_size": 32, "model.num_attention_heads": 2,
            "model.ffn_hidden_size": 64, "memory.layers": "[1]"}


def fe_pretrain_in_process(argv: list) -> int:
    """`fe_megatron.train.main` in the test process, its launcher variables (RANK, MASTER_PORT, ...) dropped after."""
    import os

    from fe_megatron.train import main

    saved = dict(os.environ)
    try:
        return main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_a_megatron_engine_run_leaves_torch_and_megatron_as_they_were(small_data):
    """Everything the run patched (the CPU backend, the tables' gradients into ``main_grad``) is the
    original object again once it has ended: nothing stays installed in the process (docs/architecture.md)."""
    from tests.helpers.patched import changed, snapshot
    from tests.helpers.paths import CONFIG
    from tests.helpers.training import small_overrides

    before = snapshot()
    assert fe_pretrain_in_process(["--config", CONFIG] + small_overrides(small_data, **TINY_RUN)) == 0
    assert changed(before, snapshot()) == []


def test_a_megatron_engine_run_that_fails_leaves_them_as_they_were_too(small_data, monkeypatch):
    from fe_megatron.training import loop
    from tests.helpers.patched import changed, snapshot
    from tests.helpers.paths import CONFIG
    from tests.helpers.training import small_overrides

    before = snapshot()
    during = {}

    def fail(run):
        during.update(snapshot())
        raise RuntimeError("the run failed after its set-up")

    monkeypatch.setattr(loop, "train", fail)
    with pytest.raises(RuntimeError, match="the run failed after its set-up"):
        fe_pretrain_in_process(["--config", CONFIG] + small_overrides(small_data, **TINY_RUN))
    installed = changed(before, during)
    assert any(line.startswith("ops.weight_gradient_sinks()") for line in installed), installed
    if not torch.cuda.is_available():  # the CPU backend
        assert any(line.startswith("torch.Tensor.cuda") for line in installed), installed
    assert changed(before, snapshot()) == []


def test_a_megatron_engine_run_with_its_documents_isolated_trains(small_data, tmp_path):
    """``data.reset_position_ids`` and ``data.reset_attention_mask``: each sample's own mask reaches megatron-core's
    attention, its position ids the memory's hash (tests/unit/megatron/test_batch.py checks both), and the run
    trains as any other."""
    import json

    from tests.helpers.paths import CONFIG
    from tests.helpers.training import small_overrides

    isolated = dict(TINY_RUN, **{"data.reset_position_ids": "true", "data.reset_attention_mask": "true"})
    assert fe_pretrain_in_process(["--config", CONFIG, "--save", str(tmp_path / "run")]
                                  + small_overrides(small_data, **isolated)) == 0
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    losses = [record["lm_loss"] for record in records if "lm_loss" in record]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
