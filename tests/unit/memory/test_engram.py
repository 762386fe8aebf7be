"""Engram (`fe_megatron.memory.engram`) against an independent, straightforward computation of Eq. 14."""

import math

import pytest
import torch

from fe_megatron.memory import Engram
from tests.helpers.configs import small_config
from tests.helpers.hashing import python_reference_indices
from tests.helpers.memory import randomize, rms_norm, short_conv_loop


@pytest.mark.parametrize("gate", ["scalar", "none"])
def test_engram_equations(gate):
    cfg = small_config(kind="engram", gate=gate, memory_dim=24)
    module = randomize(Engram(cfg, 1).double())
    h = torch.randn(3, 9, cfg.hidden_size, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (3, 9))
    m, l1 = module(h, ids)
    idx = torch.tensor(python_reference_indices(cfg, 1, ids.tolist()))
    emb = torch.cat([module.tables.weight[idx[..., b]] for b in range(idx.shape[-1])], -1)
    v = emb @ module.value_proj.weight.flatten(1).t()  # [out, branches, s_b] is nn.Linear's [out, s] per branch
    if gate == "scalar":
        k = rms_norm(emb @ module.key_proj.weight.flatten(1).t(), module.key_norm.weight, cfg.norm_eps)
        hq = rms_norm(h, module.query_norm.weight, cfg.norm_eps)
        g = (k * hq).sum(-1, keepdim=True) / math.sqrt(cfg.hidden_size)
        v = torch.sigmoid(torch.sign(g) * torch.sqrt(g.abs())) * v
    torch.testing.assert_close(m, v + short_conv_loop(v, module.conv), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(l1, emb.abs().sum(-1))
