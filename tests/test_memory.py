"""The memory modules against independent, straightforward computations of Eq. 6-12."""

import math

import pytest
import torch

from fe_megatron.memory import Engram, FactorEngram, ShortConv, build_memory, sparsity_loss
from tests.conftest import small_config
from tests.test_hashing import python_reference_indices


def randomize(module):
    """Non-trivial weights everywhere (the conv starts at zero, the norms at one)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module


def rms_norm(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def short_conv_loop(v, conv):
    """Eq. 10's refinement, position by position: SiLU(sum_k w_k RMSNorm(v)_{t-(K-1-k) r})."""
    normed = rms_norm(v, conv.norm.weight, conv.norm.eps)
    out = torch.zeros_like(v)
    K, r = conv.kernel_size, conv.dilation
    for t in range(v.shape[1]):
        acc = torch.zeros_like(v[:, 0])
        for k in range(K):
            src = t - (K - 1 - k) * r
            if src >= 0:
                acc = acc + conv.weight[:, k] * normed[:, src]
        out[:, t] = torch.nn.functional.silu(acc)
    return out


def reference_factorengram(module, h, ids):
    cfg = module.config
    idx = torch.tensor(python_reference_indices(cfg, module.layer_number, ids.tolist()))
    table = module.tables.weight
    z = torch.cat([table[idx[..., b]] for b in range(idx.shape[-1])], -1)  # Eq. 6: concat in branch order
    D = module.dictionary
    if cfg.gate == "none":
        e = z @ D
    else:
        q = rms_norm(h @ module.query_proj.weight.t(), module.query_norm.weight, cfg.norm_eps)  # Eq. 7
        if cfg.gate == "basis":
            alpha = 1 / (1 + torch.exp(-(q @ D.t()) / math.sqrt(cfg.hidden_size)))  # Eq. 7
            e = torch.einsum("bts,sm->btm", z * alpha, D)  # Eq. 8, 9
        else:
            e0 = z @ D
            a = torch.sigmoid((e0 * q).sum(-1, keepdim=True) / math.sqrt(cfg.hidden_size))  # Eq. 11
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


@pytest.mark.parametrize("gate", ["scalar", "none"])
def test_engram_equations(gate):
    cfg = small_config(representation="dense", gate=gate, memory_dim=24)
    module = randomize(Engram(cfg, 1).double())
    h = torch.randn(3, 9, cfg.hidden_size, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (3, 9))
    m, l1 = module(h, ids)
    idx = torch.tensor(python_reference_indices(cfg, 1, ids.tolist()))
    emb = torch.cat([module.tables.weight[idx[..., b]] for b in range(idx.shape[-1])], -1)
    v = emb @ module.value_proj.weight.t()
    if gate == "scalar":
        k = rms_norm(emb @ module.key_proj.weight.t(), module.key_norm.weight, cfg.norm_eps)
        hq = rms_norm(h, module.query_norm.weight, cfg.norm_eps)
        g = (k * hq).sum(-1, keepdim=True) / math.sqrt(cfg.hidden_size)
        v = torch.sigmoid(torch.sign(g) * torch.sqrt(g.abs())) * v
    torch.testing.assert_close(m, v + short_conv_loop(v, module.conv), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(l1, emb.abs().sum(-1))


@pytest.mark.parametrize("representation", ["factorized", "dense"])
def test_branch_starts_as_identity_and_learns(representation):
    cfg = small_config(representation=representation, gate="scalar", memory_dim=24 if representation == "dense" else 12)
    module = build_memory(cfg, 1)
    h, ids = torch.randn(1, 7, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (1, 7))
    m, _ = module(h, ids)
    assert torch.count_nonzero(module.conv.weight) == 0 and torch.count_nonzero(m) == 0
    (m * torch.randn_like(m)).sum().backward()
    assert module.value_proj.weight.grad.abs().sum() > 0  # V learns from the first step
    if representation == "factorized":
        alpha = torch.sigmoid(module.query(h) @ module.dictionary.t() / math.sqrt(cfg.hidden_size))
        assert 0.3 < alpha.mean() < 0.7  # gates start uninformative


@pytest.mark.parametrize("representation, gate", [("factorized", "basis"), ("factorized", "scalar"),
                                                  ("factorized", "none"), ("dense", "scalar"), ("dense", "none")])
def test_causality(representation, gate):
    cfg = small_config(representation=representation, gate=gate, memory_dim=24 if representation == "dense" else 12)
    module = randomize(build_memory(cfg, 1).double())
    T = 16
    h = torch.randn(2, T, cfg.hidden_size, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (2, T))
    m, l1 = module(h, ids)
    for t in (0, 5, T - 2):
        h2, ids2 = h.clone(), ids.clone()
        h2[:, t + 1:] = torch.randn_like(h2[:, t + 1:])
        ids2[:, t + 1] = (ids2[:, t + 1] + 1 + torch.randint(0, cfg.vocab_size - 1, (2,))) % cfg.vocab_size
        m2, l12 = module(h2, ids2)
        torch.testing.assert_close(m2[:, :t + 1], m[:, :t + 1], rtol=0, atol=0)
        torch.testing.assert_close(l12[:, :t + 1], l1[:, :t + 1], rtol=0, atol=0)
        assert not torch.equal(m2[:, t + 1], m[:, t + 1])


def test_gradients_reach_exactly_the_looked_up_rows():
    cfg = small_config()
    module = randomize(FactorEngram(cfg, 3))
    h, ids = torch.randn(2, 13, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (2, 13))
    m, l1 = module(h, ids)
    (m.pow(2).sum() + l1.sum()).backward()
    touched = torch.nonzero(module.tables.weight.grad.abs().sum(-1)).flatten()
    looked_up = torch.unique(module.hasher.indices(ids))
    assert torch.equal(touched, looked_up)


@pytest.mark.parametrize("representation, gate, placement", [
    ("factorized", "basis", "before_attn"), ("factorized", "scalar", "before_ffn"), ("factorized", "none", "inside_ffn"),
    ("dense", "scalar", "before_attn"), ("dense", "none", "inside_ffn")])
def test_every_variant_runs_forward_and_backward(representation, gate, placement):
    cfg = small_config(representation=representation, gate=gate, placement=placement,
                       memory_dim=24 if representation == "dense" else 12)
    module = randomize(build_memory(cfg, 1))
    h = torch.randn(2, 10, cfg.hidden_size, requires_grad=True)
    m, l1 = module(h, torch.randint(0, cfg.vocab_size, (2, 10)))
    (m.square().mean() + 1e-3 * l1.mean()).backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    if gate != "none":
        assert h.grad.abs().sum() > 0


def test_bf16_forward_backward():
    cfg = small_config()
    module = randomize(FactorEngram(cfg, 1)).to(torch.bfloat16)
    h = torch.randn(2, 8, cfg.hidden_size, dtype=torch.bfloat16)
    m, l1 = module(h, torch.randint(0, cfg.vocab_size, (2, 8)))
    assert m.dtype == torch.bfloat16
    m.float().sum().backward()


def test_precomputed_indices_equal_token_ids_path():
    cfg = small_config()
    module = randomize(FactorEngram(cfg, 1))
    h, ids = torch.randn(2, 8, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (2, 8))
    a, _ = module(h, ids)
    b, _ = module(h, indices=module.hasher.indices(ids))
    assert torch.equal(a, b)


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


@pytest.mark.parametrize("h_shape, ids, error, fragment", [
    ((2, 5, 8), torch.zeros(2, 5, dtype=torch.long), ValueError, r"hidden_size=16\], got \(2, 5, 8\)"),
    ((2, 5, 16), torch.zeros(2, 4, dtype=torch.long), ValueError, r"do not match hidden_states \[batch, seq\] = \(2, 5\)"),
    ((2, 5, 16), torch.full((2, 5), 500), ValueError, r"token id 500 .* outside the vocabulary range \[0, 97\)"),
    ((2, 5, 16), torch.full((2, 5), -1), ValueError, r"token id -1"),
    ((2, 5, 16), torch.zeros(2, 5), TypeError, r"integer tensor"),
    ((2, 5, 16), None, ValueError, r"exactly one of token_ids"),
])
def test_bad_inputs(h_shape, ids, error, fragment):
    module = FactorEngram(small_config(), 1)
    with pytest.raises(error, match=fragment):
        module(torch.randn(*h_shape), ids)


def test_wrong_representation_for_class():
    with pytest.raises(ValueError, match="FactorEngram needs representation='factorized'"):
        FactorEngram(small_config(representation="dense", gate="scalar", memory_dim=24), 1)
    with pytest.raises(ValueError, match="Engram needs representation='dense'"):
        Engram(small_config(), 1)


def test_sparsity_loss_eq12():
    a, b = torch.rand(2, 6), torch.rand(2, 6)
    expected = sum((a[i, t] + b[i, t]) / 2 for i in range(2) for t in range(6)) / 12
    torch.testing.assert_close(sparsity_loss([a, b]), expected)
    mask = torch.zeros(2, 6)
    mask[0, :3] = 1
    torch.testing.assert_close(sparsity_loss([a, b], mask), ((a + b) / 2)[0, :3].mean())
    with pytest.raises(ValueError, match="at least one insertion layer"):
        sparsity_loss([])
