"""`fe_megatron.megatron.cpu_backend`: enabled once, idempotent, and nothing changes outside megatron.core."""

import torch


def test_cpu_backend_is_enabled_and_idempotent(megatron_world):
    from fe_megatron.megatron import enable_cpu_backend
    from megatron.core.tensor_parallel import random as mcore_random

    assert enable_cpu_backend() is (not torch.cuda.is_available())
    assert enable_cpu_backend() is (not torch.cuda.is_available())
    if not torch.cuda.is_available():
        state = mcore_random._get_cuda_rng_state()
        assert torch.equal(state, torch.get_rng_state())
        assert torch.zeros(1).type() == "torch.FloatTensor"  # outside megatron.core nothing changes
