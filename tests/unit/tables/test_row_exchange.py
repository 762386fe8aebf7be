"""Tables sharded by rows (`fe_megatron.tables.row_exchange.RowPartition`): every row once, regathered by
a group of another size, and a group larger than a branch refused."""

import pytest
import torch

from fe_megatron.tables.row_exchange import RowPartition


def partitions(branch_rows, size):
    offsets = [0]
    for rows in branch_rows[:-1]:
        offsets.append(offsets[-1] + rows)
    return [RowPartition(tuple(branch_rows), tuple(offsets), size, rank) for rank in range(size)]


@pytest.mark.parametrize("branch_rows, size", [((10, 9, 97), 4), ((5,), 5), ((1000, 5003, 7001), 7), ((3, 8), 1)])
def test_partition_covers_every_row_once_and_locates_it(branch_rows, size):
    ranks = partitions(branch_rows, size)
    full = torch.randn(sum(branch_rows), 3)
    shards = [p.take(full) for p in ranks]
    owner, local = ranks[0].locate(torch.arange(sum(branch_rows)))
    assert torch.equal(torch.stack([shards[o][i] for o, i in zip(owner.tolist(), local.tolist())]), full)
    assert torch.equal(ranks[0].assemble(shards), full)
    for p, shard in zip(ranks, shards):
        assert p.local_rows() == shard.shape[0]
        for branch, rows in enumerate(branch_rows):  # every rank holds about 1/N of every branch
            start, stop = p.branch_range(branch)
            assert rows // size <= stop - start <= rows // size + 1


@pytest.mark.parametrize("saved_size, size", [(2, 1), (3, 2), (2, 5), (1, 4), (7, 3)])
def test_rows_saved_by_one_group_size_are_regathered_by_another(saved_size, size):
    """A checkpoint's per-rank shards, read by a group of another size: each new rank gets exactly
    its own rows of the whole table (a run restarted on fewer or more nodes)."""
    branch_rows = (10, 9, 97)
    full = torch.randn(sum(branch_rows), 4)
    saved = [p.take(full) for p in partitions(branch_rows, saved_size)]
    for p in partitions(branch_rows, size):
        assert torch.equal(p.gather_from(saved), p.take(full))


def test_group_larger_than_a_branch_is_refused_naming_the_sizes():
    with pytest.raises(ValueError, match=r"the memory-parallel group has 4 ranks but branch 0 of this layer has only "
                                         r"3 rows; every rank must own rows of every branch"):
        partitions((3, 10), 4)
