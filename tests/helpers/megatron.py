"""The tiny Megatron GPT (`tests.helpers.configs`) built in the test process, and random batches for it.
Needs megatron.core's process groups: the ``megatron_world`` fixture."""

import torch

from tests.helpers.configs import tiny_transformer_config


def build(memory_config=None, table_sharding: str = "replicated", **transformer_overrides):
    """The tiny GPT (vocabulary 128, 32 positions) with ``memory_config``'s branches, or without memory."""
    from fe_megatron.megatron.builder import build_gpt_model

    cfg = tiny_transformer_config(**transformer_overrides)
    return build_gpt_model(cfg, 128, 32, memory_config, table_sharding=table_sharding)


def batches(n, seq=32, mbs=2):
    from fe_megatron.megatron.step import causal_mask

    out = []
    for _ in range(n):
        tokens = torch.randint(0, 128, (mbs, seq + 1))
        out.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=(torch.rand(mbs, seq) > 0.2).float(),
                        position_ids=torch.arange(seq).expand(mbs, seq), attention_mask=causal_mask(seq)))
    return out
