"""Where a run starts (`fe_megatron.checkpoint.resume.start_point`): --load and --save together.

A new run is written only into a folder without another run's checkpoints; --load of something
that is not a run directory is refused with what a run directory holds; the launch scripts'
first start (--load and --save the same, not yet existing folder) starts fresh and says so."""

import os
import types

import pytest

from fe_megatron.checkpoint.files import TRACKER, CheckpointError, iteration_dir
from fe_megatron.checkpoint.resume import start_point


def cfg(load=None, save=None):
    return types.SimpleNamespace(load=None if load is None else str(load), save=None if save is None else str(save))


def make_run(directory, iteration=60, deepspeed=False):
    """A run directory's skeleton: tracker, one iteration folder (and DeepSpeed's ``latest``)."""
    os.makedirs(iteration_dir(str(directory), iteration))
    (directory / TRACKER).write_text(str(iteration))
    if deepspeed:
        (directory / "latest").write_text(f"iter_{iteration:07d}")
    return str(directory)


def find_tracker(directory):
    text = open(os.path.join(directory, TRACKER)).read()
    return iteration_dir(directory, int(text))


def start(config, engine="megatron"):
    logged = []
    point = start_point(config, engine, find_tracker, logged.append)
    return point, logged


def test_no_load_starts_a_new_run(tmp_path):
    point, _ = start(cfg(save=tmp_path / "new"))
    assert point.kind == "new"


def test_first_start_of_a_run_that_resumes_itself(tmp_path):
    run = tmp_path / "run"  # does not exist yet: launch_scripts pass --load RUN --save RUN
    point, logged = start(cfg(run, run))
    assert point.kind == "new" and "holds no checkpoint yet and is also --save" in logged[0]
    run.mkdir()  # created, holding only the logs of a start that never saved (a restart before the first save)
    (run / "metrics.jsonl").write_text("{}\n")
    point, _ = start(cfg(run, run))
    assert point.kind == "new"


def test_resume_from_the_runs_own_folder(tmp_path):
    run = make_run(tmp_path / "run")
    point, _ = start(cfg(run, run))
    assert point.kind == "checkpoint" and point.folder == iteration_dir(run, 60)


def test_a_file_is_refused(tmp_path):
    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file; --load takes a run directory .*latest_checkpointed"):
        start(cfg(model, tmp_path / "out"))


def test_a_folder_that_is_not_a_run_is_refused(tmp_path):
    mine = tmp_path / "mine"  # a tokenizer and data, no checkpoint: the case
    (mine / "data").mkdir(parents=True)
    (mine / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"is not a run directory: it holds data, tokenizer.model\. a run "):
        start(cfg(mine, mine / "run"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="is not a run directory: it holds nothing"):
        start(cfg(empty, tmp_path / "run"))


def test_a_missing_load_that_is_not_save_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist: there is nothing to resume"):
        start(cfg(tmp_path / "typo", tmp_path / "run"))


def test_a_new_run_never_writes_into_another_runs_checkpoints(tmp_path):
    old = make_run(tmp_path / "old")
    with pytest.raises(CheckpointError, match="already holds another run's checkpoints; resume it with --load"):
        start(cfg(None, old))
    other = make_run(tmp_path / "other", iteration=80)
    with pytest.raises(CheckpointError, match=f"--save {old} already holds checkpoints, so this start would not "
                                              f"continue them from --load {other}"):
        start(cfg(other, old))  # resuming one run into another's folder
    point, _ = start(cfg(other, tmp_path / "branch"))  # branching into a fresh folder is fine
    assert point.kind == "checkpoint"
    branch = make_run(tmp_path / "branch", iteration=100)  # the branch saved; its restart names its own folder
    with pytest.raises(CheckpointError, match=f"relaunch with --load {branch} --save {branch}"):
        start(cfg(other, branch))
    assert start(cfg(branch, branch))[0].folder == iteration_dir(branch, 100)


def test_checkpoint_folders_without_a_tracker_are_never_overwritten(tmp_path):
    run = tmp_path / "run"
    os.makedirs(iteration_dir(str(run), 40))  # no tracker, no manifest: not a checkpoint we can vouch for
    with pytest.raises(CheckpointError, match="holds iter_0000040 but no complete checkpoint .*Move them out of "
                                              "the way"):
        start_point(cfg(run, run), "megatron", lambda directory: None, print)


def test_a_run_of_the_other_engine_is_named(tmp_path):
    ds = make_run(tmp_path / "ds", deepspeed=True)
    with pytest.raises(CheckpointError, match="is a run of the DeepSpeed engine"):
        start(cfg(ds, ds), "megatron")
    mc = make_run(tmp_path / "mc")
    with pytest.raises(CheckpointError, match="holds Megatron-engine checkpoints; .*mcore-to-hf"):
        start(cfg(mc, mc), "deepspeed")
    assert start(cfg(ds, ds), "deepspeed")[0].kind == "checkpoint"


def test_a_hugging_face_directory(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert start(cfg(hf, tmp_path / "run"), "deepspeed")[0].kind == "hf"
    with pytest.raises(CheckpointError, match="hf-to-mcore"):
        start(cfg(hf, tmp_path / "run"), "megatron")


