"""FactorEngram (`fe_megatron.memory.factorengram`) against an independent, straightforward computation
of Eq. 6-11, and what its forward accepts."""

import math

import pytest
import torch

from fe_megatron.memory import FactorEngram
from tests.helpers.configs import small_config
from tests.helpers.hashing import python_reference_indices
from tests.helpers.memory import randomize, rms_norm, short_conv_loop


def reference_factorengram(module, h, ids):
    cfg = module.config
    idx = torch.tensor(python_reference_indices(cfg, module.layer_index, ids.tolist()))
    table = module.tables.weight
    z = torch.cat([table[idx[..., b]] for b in range(idx.shape[-1])], -1)  # Eq. 6: concat in branch order
    D = module.dictionary.flatten(0, 1)  # [s, d_m]: D viewed per branch, flattened in branch order
    if cfg.gate == "none":
        e = z @ D
    else:
        q = rms_norm(h @ module.query_proj.weight.t(), module.query_norm.weight, cfg.norm_eps)  # Eq. 7
        if cfg.gate == "basis":
            alpha = 1 / (1 + torch.exp(-(q @ D.t()) / math.sqrt(cfg.hidden_size)))  # Eq. 7
            e = torch.einsum("bts,sm->btm", z * alpha, D)  # Eq. 8, 9
        else:
            e0 = z @ D
            a = torch.sigmoid((e0 * q).sum(-1, keepdim=True) / math.sqrt(cfg.hidden_size))  # Eq. 14
            e = a * e0
    v = e @ module.value_proj.weight.t()  # Eq. 9
    m = v + short_conv_loop(v, module.conv)  # Eq. 10
    return m, z.abs().sum(-1)


@pytest.mark.parametrize("gate", ["basis", "scalar", "none"])
@pytest.mark.parametrize("placement", ["before_attn", "inside_ffn"])
def test_factorengram_equations(gate, placement):
    cfg = small_config(gate=gate, placement=placement)
    module = randomize(FactorEngram(cfg, 3).double())
    h = torch.randn(2, 11, cfg.hidden_size, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    m, l1 = module(h, ids)
    m_ref, l1_ref = reference_factorengram(module, h, ids)
    assert m.shape == (2, 11, cfg.output_size)
    torch.testing.assert_close(m, m_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(l1, l1_ref, rtol=1e-12, atol=1e-12)


def test_a_started_lookup_equals_the_token_ids_path():
    cfg = small_config()
    module = randomize(FactorEngram(cfg, 1))
    h, ids = torch.randn(2, 8, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (2, 8))
    a, _ = module(h, ids)
    b, _ = module(h, lookup=module.start_lookup(module.addresses(ids)))
    assert torch.equal(a, b)
    assert torch.equal(module.addresses(ids), module.hasher.indices(ids))


def test_addresses_in_place_of_a_started_lookup_are_refused_by_name():
    cfg = small_config()
    module = randomize(FactorEngram(cfg, 1))
    h, ids = torch.randn(2, 8, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (2, 8))
    with pytest.raises(TypeError, match="started lookup"):
        module(h, lookup=module.addresses(ids))


def test_token_id_dtypes_named_in_the_error_are_the_accepted_ones():
    module = FactorEngram(small_config(), 1)
    h = torch.randn(1, 5, 16)
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        module(h, torch.randint(0, 90, (1, 5)).to(dtype))
    with pytest.raises(TypeError, match=r"integer tensor \(int64, int32, int16, uint8\), got dtype torch.float32"):
        module(h, torch.zeros(1, 5))


def test_reset_parameters_is_reproducible_and_seeded_from_torch():
    cfg = small_config()
    a, b = FactorEngram(cfg, 1, initialize=False), FactorEngram(cfg, 1, initialize=False)
    a.reset_parameters(seed=5)
    b.reset_parameters(seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    torch.manual_seed(0)
    c, d = FactorEngram(cfg, 1), FactorEngram(cfg, 1)  # two modules in a row differ, as nn.Linear's do
    assert not torch.equal(c.tables.weight, d.tables.weight)
    assert c.tables.weight.std().item() == pytest.approx(cfg.table_init_std, rel=0.05)
