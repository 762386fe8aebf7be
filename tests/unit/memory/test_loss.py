"""`fe_megatron.memory.loss`: the sparsity objective, Eq. 12."""

import pytest
import torch

from fe_megatron.memory import sparsity_loss


def test_sparsity_loss_eq12():
    a, b = torch.rand(2, 6), torch.rand(2, 6)
    expected = sum((a[i, t] + b[i, t]) / 2 for i in range(2) for t in range(6)) / 12
    torch.testing.assert_close(sparsity_loss([a, b]), expected)
    mask = torch.zeros(2, 6)
    mask[0, :3] = 1
    torch.testing.assert_close(sparsity_loss([a, b], mask), ((a + b) / 2)[0, :3].mean())
    with pytest.raises(ValueError, match="at least one insertion layer"):
        sparsity_loss([])
