"""`fe_megatron.tables.store`: the host tier adds row gradients in arrival order, bit for bit."""

import torch


def test_host_gradients_are_added_in_arrival_order():
    """The worker thread adds the host tier's row gradients in the order they arrive: the result is
    bit for bit that of adding them at once, once `wait_for_gradients` returns."""
    from fe_megatron.tables.store import TableStore

    host, direct = TableStore(torch.zeros(50, 8), "host"), torch.zeros(50, 8)
    host.allocate_gradient(torch.float32)
    for _ in range(20):
        ids, rows = torch.randint(0, 50, (64,)), torch.randn(64, 8)
        host.accumulate(ids, rows)
        direct.index_add_(0, ids, rows)
    host.wait_for_gradients()
    assert torch.equal(host.main_grad, direct)
