"""The language-model loss every trainer computes (`fe_megatron.training.losses`): Megatron-LM's sum and
token count, fe-pretrain's mean, and the DeepSpeed engine's cross-entropy of logits are one definition."""

import torch
import torch.nn.functional as F

from fe_megatron.training.losses import masked_mean, masked_sum, per_token_cross_entropy


def test_the_sum_the_mean_and_the_cross_entropy_are_one_definition():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, 11, generator=gen, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 7), generator=gen)
    mask = (torch.rand(2, 7, generator=gen) > 0.3).float()
    per_token = per_token_cross_entropy(logits, labels)
    assert per_token.dtype == torch.float32 and per_token.shape == (14,)
    expected = torch.stack([F.cross_entropy(logits[b, t].float(), labels[b, t]) for b in range(2) for t in range(7)])
    torch.testing.assert_close(per_token, expected)
    total, tokens = masked_sum(per_token.view(2, 7), mask)
    assert float(tokens) == float(mask.sum())
    torch.testing.assert_close(total, (expected * mask.view(-1)).sum())
    assert torch.equal(masked_mean(per_token.view(2, 7), mask), total / tokens)
    assert float(masked_mean(per_token, torch.zeros(14))) == 0.0  # no kept position: no division by zero
