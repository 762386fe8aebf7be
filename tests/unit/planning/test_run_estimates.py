"""`fe_megatron.planning.run_estimates`: the activation estimate follows recompute, precision and tensor
parallelism."""

import pytest


def test_activation_estimate_follows_recompute_precision_and_tensor_parallelism():
    from fe_megatron.config import MemoryConfig
    from fe_megatron.planning.run_estimates import activation_bytes

    config = MemoryConfig.from_preset("factorengram-340m")
    base = dict(tp=1, pp=1, micro_batch_size=1, seq_length=4096, precision="bf16", recompute="none", microbatches=8)
    full = activation_bytes(config, **base)
    s, h, layers = 4096, config.hidden_size, config.num_layers
    logits = 4 * s * config.vocab_size
    assert activation_bytes(config, **base, fused_attention=True) == pytest.approx(
        layers * s * h * 34 + 2 * s * (3 * config.coeff_width + 2 * config.memory_dim + 3 * h) * 2 + logits)
    assert activation_bytes(config, **{**base, "recompute": "full"}) < full / 5
    assert activation_bytes(config, **{**base, "precision": "fp32"}) - logits == pytest.approx(2 * (full - logits))
    tp2 = activation_bytes(config, **{**base, "tp": 2}, sequence_parallel=True, fused_attention=True)
    assert tp2 < activation_bytes(config, **base, fused_attention=True) / 1.9
