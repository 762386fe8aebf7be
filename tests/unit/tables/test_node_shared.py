"""Node-shared tables' segments (`fe_megatron.tables.node_shared`), in one process: a shard moves into a
segment that leaves nothing in its folder, a dead run's files are cleared and a live one's kept, and a
folder too small refuses the run with the bytes needed and free.  The exchange over several ranks and
nodes: tests/distributed/check_stage_exchange.py."""

import os

import pytest
import torch

from fe_megatron.tables.layout import TableLayout
from fe_megatron.tables.node_shared import PREFIX, folder_free_bytes, remove_dead_segments, share_node_rows
from fe_megatron.tables.row_exchange import RowPartition
from fe_megatron.tables.store import TableStore


def host_store(rows: int, width: int = 4, table: int = 3, dtype=torch.float32) -> TableStore:
    weight = torch.randn(rows, width).to(dtype)
    return TableStore(weight, "host", TableLayout(table, ((0, rows, 0),), 0, width))


def whole(rows: int) -> RowPartition:
    return RowPartition((rows,), (0,), 1, 0)


def dead_pid() -> int:
    """A process id no live process has (past the kernel's largest)."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shard_moves_into_a_segment_that_leaves_nothing_in_the_folder(tmp_path, dtype):
    store = host_store(13, dtype=dtype)
    rows = store.weight.clone()
    names = share_node_rows([store], [whole(13)], None, str(tmp_path))
    assert len(names) == 1 and names[0].startswith(PREFIX) and names[0].endswith(".table3")
    assert os.listdir(tmp_path) == []  # removed once mapped: the kernel frees it with the last process
    assert store.weight.is_shared() and store.weight.dtype == dtype and torch.equal(store.weight, rows)
    segment = store.node.segment.weight
    store.weight[2].fill_(7.0)  # the store's rows are the segment's
    assert torch.equal(segment[2], torch.full((4,), 7.0, dtype=dtype))
    ids = torch.tensor([2, 0, 12])
    assert torch.equal(store.node.read(torch.zeros(3, dtype=torch.int64), ids, "cpu").wait(), store.weight[ids])


def test_a_dead_run_s_segments_are_removed_and_a_live_run_s_kept(tmp_path, capsys):
    dead = tmp_path / f"{PREFIX}0badc0de.{dead_pid()}.rank0.table1"
    live = tmp_path / f"{PREFIX}feedf00d.{os.getpid()}.rank0.table1"
    other = tmp_path / "someone-else.table1"
    for path in (dead, live, other):
        path.write_bytes(b"x" * 64)
    assert remove_dead_segments(str(tmp_path)) == [dead.name]
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name])
    dead.write_bytes(b"x")
    share_node_rows([host_store(5)], [whole(5)], None, str(tmp_path))  # a new run clears them at its start
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name])
    assert "removed 1 segment file(s)" in capsys.readouterr().out


def test_a_folder_too_small_refuses_the_run_with_the_bytes_needed_and_free(tmp_path):
    free = folder_free_bytes(str(tmp_path))
    rows = free // 16 + 1024  # more rows of 4 fp32 than the folder holds (a view: no memory taken)
    store = TableStore(torch.zeros(1, 4).expand(rows, 4), "host", TableLayout(0, ((0, rows, 0),), 0, 4))
    with pytest.raises(RuntimeError, match=rf"need {rows * 16:,} bytes .* in {tmp_path} on this node, and it has "
                                           r"[\d,]+ bytes .* free"):
        share_node_rows([store], [whole(rows)], None, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_device_tables_and_a_missing_folder_are_refused(tmp_path):
    device_store = TableStore(torch.randn(5, 4), "device")
    with pytest.raises(ValueError, match="memory.table_placement: host"):
        share_node_rows([device_store], [whole(5)], None, str(tmp_path))
    with pytest.raises(RuntimeError, match="does not exist"):
        share_node_rows([host_store(5)], [whole(5)], None, str(tmp_path / "missing"))
