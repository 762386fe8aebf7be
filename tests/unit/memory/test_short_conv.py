"""`fe_megatron.memory.short_conv`: a chunk given its history equals the full sequence's outputs."""

import torch

from fe_megatron.memory import ShortConv
from tests.helpers.memory import randomize


def test_short_conv_history_equals_full_sequence():
    """Outputs for a chunk given >= receptive-field rows of history equal the full-sequence outputs
    (what a sequence-parallel rank computes from its neighbour's halo)."""
    conv = randomize(ShortConv(6, 4, 3)).double()
    v = torch.randn(2, 20, 6, dtype=torch.float64)
    full = conv(v)
    start = 12
    for history in (conv.receptive_field, start):
        torch.testing.assert_close(conv(v[:, start - history:], history=history), full[:, start:])
    assert not torch.allclose(conv(v[:, start:]), full[:, start:])  # without history the chunk differs
