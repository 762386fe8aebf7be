"""DeepSpeed's shared-memory all-reduce buffers (`fe_megatron.deepspeed.shm_buffers`): this rank's name from the
launcher's environment, and a killed run's files removed while a live run's, a starting run's and another
program's are kept."""

import mmap
import os

from fe_megatron.deepspeed import shm_buffers

LAUNCHED = {"LOCAL_SIZE": "2", "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_a_rank_s_buffer_is_named_as_deepspeed_names_it_and_only_when_every_rank_is_local():
    assert shm_buffers.own_buffer_name(LAUNCHED) == f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29500_1"
    assert shm_buffers.own_buffer_name(dict(LAUNCHED, LOCAL_SIZE="1")) is None  # across nodes: no buffer
    assert shm_buffers.own_buffer_name({k: v for k, v in LAUNCHED.items() if k != "LOCAL_SIZE"}) is None  # torchrun


def test_the_own_buffer_is_removed_at_the_end(tmp_path):
    path = tmp_path / shm_buffers.own_buffer_name(LAUNCHED)
    path.write_bytes(b"\0" * 64)
    assert shm_buffers.remove_own_buffer(str(tmp_path), LAUNCHED) and not path.exists()
    assert not shm_buffers.remove_own_buffer(str(tmp_path), LAUNCHED)


def test_only_a_killed_run_s_buffers_are_removed(tmp_path):
    def buffer(name, age_s):
        path = tmp_path / name
        path.write_bytes(b"\0" * 4096)
        os.utime(path, (1e9 - age_s, 1e9 - age_s))
        return path

    killed = buffer(f"{shm_buffers.PREFIX}{os.getuid()}_127.0.0.1_29500_0", 600)
    starting = buffer(f"{shm_buffers.PREFIX}{os.getuid()}_127.0.0.1_29501_0", 10)
    live = buffer(f"{shm_buffers.PREFIX}{os.getuid()}_127.0.0.1_29502_0", 600)
    other = buffer("another_program_0", 600)
    with open(live, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):  # a live run maps every rank's buffer
        assert shm_buffers.remove_dead_buffers(str(tmp_path), now=1e9) == [killed.name]
    assert not killed.exists() and starting.exists() and live.exists() and other.exists()
