"""`fe_megatron.megatron_lm.fsdp_checkpoint.checkpoint_to_load`: the folder Megatron-LM's loader reads, so
that the tables are read from the same checkpoint, and no loader runs where there is nothing to load (the
recipes' first launch: megatron-core 0.19's fsdp_dtensor loader would step the fresh optimizer once)."""

import argparse
import os

from fe_megatron.megatron_lm.fsdp_checkpoint import checkpoint_to_load


def run_dir(path, tracker: str):
    os.makedirs(path / "iter_0000004")
    (path / "latest_checkpointed_iteration.txt").write_text(tracker)
    return str(path)


def args(load=None, pretrained=None, step=None):
    return argparse.Namespace(load=load, pretrained_checkpoint=pretrained, ckpt_step=step)


def test_the_folder_to_load_is_the_one_megatron_lm_reads(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = run_dir(tmp_path / "run", "4\n")
    pretrained = run_dir(tmp_path / "pretrained", "release")
    assert checkpoint_to_load(args()) is None
    assert checkpoint_to_load(args(load=str(empty))) is None  # a first launch: --save and --load one folder
    assert checkpoint_to_load(args(load=str(tmp_path / "missing"))) is None
    assert checkpoint_to_load(args(load=run)) == os.path.join(run, "iter_0000004")
    assert checkpoint_to_load(args(load=run, step=2)) == os.path.join(run, "iter_0000002")
    # --load wins where it holds a checkpoint; else --pretrained-checkpoint, here a release checkpoint
    assert checkpoint_to_load(args(load=run, pretrained=pretrained)) == os.path.join(run, "iter_0000004")
    assert checkpoint_to_load(args(load=str(empty), pretrained=pretrained)) == os.path.join(pretrained, "release")
