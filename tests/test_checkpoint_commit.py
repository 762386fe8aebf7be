"""The save protocol every engine uses (`fe_megatron.checkpoint.commit`), in one process.

The order of the file-system operations is the guarantee: files are hashed into a manifest
before the folder is renamed into place; the run directory is synced after the rename (so the
rename survives a power loss) and before the tracker names the new checkpoint."""

import os

import pytest
import torch.distributed as dist

from fe_megatron.checkpoint import commit as commit_module
from fe_megatron.checkpoint.files import MANIFEST, TRACKER, CheckpointError, read_manifest, read_tracker


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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
