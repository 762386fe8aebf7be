import os
import random

import pytest
import torch

from fe_megatron.config import MemoryConfig

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared")


def small_config(**overrides) -> MemoryConfig:
    """A configuration small enough for exact float64 checks."""
    values = dict(vocab_size=97, hidden_size=16, num_layers=4, ffn_hidden_size=24, ngram_orders=[1, 2, 3],
                  heads_per_order=2, table_capacity=[97, 211, 307], coeff_width=24, memory_dim=12, layers=[1, 3],
                  conv_kernel_size=3, conv_dilation=2, hash_seed=7)
    values.update(overrides)
    return MemoryConfig(**values)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different seed per test (derived from its name): random but reproducible inputs."""
    seed = abs(hash(request.node.nodeid)) % (2 ** 31)
    random.seed(seed)
    torch.manual_seed(seed)
    yield
