"""The save protocol every engine uses (`fe_megatron.checkpoint.commit`), in one process.

The order of the file-system operations is the guarantee: files are hashed into a manifest
before the folder is renamed into place; the run directory is synced after the rename (so the
rename survives a power loss) and before the tracker names the new checkpoint."""

import os

import pytest

from fe_megatron.checkpoint import commit as commit_module
from fe_megatron.checkpoint.files import MANIFEST, TRACKER, CheckpointError, read_manifest, read_tracker


def test_the_rename_is_synced_before_the_tracker_names_it(tmp_path, process_group, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    events = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src, dst):
        events.append(("replace", os.path.basename(str(src)), os.path.basename(str(dst))))
        return real_replace(src, dst)

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    tmp = commit_module.start_save(str(run), 7)
    with open(os.path.join(tmp, "weights.pt"), "wb") as fh:
        fh.write(os.urandom(1000))
    commit_module.agree_on_failure(None, tmp, 7)
    final = commit_module.commit(tmp, str(run), 7, keep=1)
    assert final == str(run / "iter_0000007") and read_tracker(str(run)) == 7
    assert sorted(read_manifest(final)["files"]) == ["weights.pt"]
    rename = events.index(("replace", "iter_0000007.tmp", "iter_0000007"))
    tracker = events.index(("replace", TRACKER + ".tmp", TRACKER))
    manifest = events.index(("replace", MANIFEST + ".tmp", MANIFEST))
    assert manifest < rename < tracker
    assert ("fsync", "run") in events[rename + 1:tracker], events  # the directory, between rename and tracker
    assert events[-1] == ("fsync", "run") or ("fsync", "run") in events[tracker + 1:], events  # and the tracker's


def test_a_failed_write_leaves_no_folder_and_keeps_the_tracker(tmp_path, process_group):
    run = tmp_path / "run"
    run.mkdir()
    tmp = commit_module.start_save(str(run), 3)
    with pytest.raises(CheckpointError, match="saving iteration 3 failed on 1 rank.*tracker still names"):
        commit_module.agree_on_failure(OSError("disk full"), tmp, 3)
    assert not os.path.exists(tmp) and read_tracker(str(run)) is None


def test_deepspeeds_latest_is_written_between_the_rename_and_the_tracker(tmp_path, process_group, monkeypatch):
    """A stop at any point leaves ``latest`` and the tracker each naming a complete checkpoint."""
    from fe_megatron.deepspeed.engine import write_deepspeed_latest

    run = tmp_path / "run"
    run.mkdir()
    events = []
    real_replace = os.replace

    def replace(src, dst):
        events.append(os.path.basename(str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    tmp = commit_module.start_save(str(run), 5)
    (tmp_path / "run" / "iter_0000005.tmp" / "model.pt").write_bytes(os.urandom(100))
    commit_module.commit(tmp, str(run), 5, before_tracker=lambda final: write_deepspeed_latest(str(run), final))
    assert events == [MANIFEST, "iter_0000005", "latest", TRACKER]
    assert (run / "latest").read_text() == "iter_0000005"


def test_a_renamed_checkpoint_without_a_tracker_is_resumed(tmp_path, process_group):
    """A stop between the first rename and the tracker: the folder is complete (its manifest was
    written before the rename), so the restart resumes from it after checking its files."""
    run = tmp_path / "run"
    run.mkdir()
    tmp = commit_module.start_save(str(run), 9)
    (run / "iter_0000009.tmp" / "model.pt").write_bytes(os.urandom(100))
    commit_module.commit(tmp, str(run), 9)
    os.remove(run / TRACKER)
    logged = []
    assert commit_module.find_checkpoint(str(run), log=logged.append) == str(run / "iter_0000009")
    assert "no latest_checkpointed_iteration.txt but holds iter_0000009 with its manifest" in logged[0]
    (run / "iter_0000009" / "model.pt").write_bytes(b"changed")
    with pytest.raises(CheckpointError, match="model.pt: 7 bytes, the manifest says 100"):
        commit_module.find_checkpoint(str(run), log=logged.append)
