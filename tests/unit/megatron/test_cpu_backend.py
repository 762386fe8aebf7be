"""`fe_megatron.megatron.cpu_backend`: installed into a patch scope, once however often it is asked for,
nothing changes outside megatron.core, and everything is undone when the scope closes."""

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is off on a machine with CUDA")
def test_the_cpu_backend_lasts_as_long_as_its_scope():
    """The first test of the file: no Megatron world (`megatron_world`) is open yet."""
    from megatron.core import utils as mcore_utils
    from megatron.core.tensor_parallel import random as mcore_random

    from fe_megatron.megatron import PatchScope, enable_cpu_backend

    original = (torch.Tensor.type, torch.Tensor.cuda, mcore_utils.torch, mcore_random._get_cuda_rng_state)
    with PatchScope() as scope:
        assert enable_cpu_backend(scope=scope)
        assert mcore_utils.torch is not torch and torch.Tensor.type is not original[0]
        with PatchScope() as inner:  # enabled around it already: nothing is installed twice
            assert enable_cpu_backend(trainer=False, scope=inner)
            assert torch.zeros(1).type() == "torch.FloatTensor"  # outside megatron.core nothing changes
    after = (torch.Tensor.type, torch.Tensor.cuda, mcore_utils.torch, mcore_random._get_cuda_rng_state)
    assert all(now is then for now, then in zip(after, original)), after


def test_cpu_backend_is_enabled_and_idempotent(megatron_world):
    from fe_megatron.megatron import enable_cpu_backend
    from megatron.core.tensor_parallel import random as mcore_random

    assert enable_cpu_backend() is (not torch.cuda.is_available())
    assert enable_cpu_backend() is (not torch.cuda.is_available())
    if not torch.cuda.is_available():
        state = mcore_random._get_cuda_rng_state()
        assert torch.equal(state, torch.get_rng_state())
        assert torch.zeros(1).type() == "torch.FloatTensor"  # outside megatron.core nothing changes
