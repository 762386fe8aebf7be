"""The memory modules against independent, straightforward computations of Eq. 6-12."""

import math

import pytest
import torch

from fe_megatron.memory import Engram, FactorEngram, ShortConv, build_memory, sparsity_loss
from tests.helpers.configs import small_config
from tests.helpers.hashing import python_reference_indices


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


@pytest.mark.parametrize("kind", ["factorengram", "engram"])
def test_branch_starts_as_identity_and_learns(kind):
    cfg = small_config(kind=kind, gate="scalar", memory_dim=24 if kind == "engram" else 12)
    module = build_memory(cfg, 1)
    h, ids = torch.randn(1, 7, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (1, 7))
    m, _ = module(h, ids)
    assert torch.count_nonzero(module.conv.weight) == 0 and torch.count_nonzero(m) == 0
    target = torch.randn_like(m)
    (m * target).sum().backward()
    assert module.value_proj.weight.grad.abs().sum() > 0  # V learns from the first step
    with torch.no_grad():  # one gradient step leaves the identity and lowers the objective (0 before it)
        for param in module.parameters():
            if param.grad is not None:
                param -= 0.1 * param.grad
        stepped, _ = module(h, ids)
    assert torch.count_nonzero(stepped) > 0 and (stepped * target).sum() < 0
    if kind == "factorengram":
        alpha = torch.sigmoid(module.query(h) @ module.dictionary.flatten(0, 1).t() / math.sqrt(cfg.hidden_size))
        assert 0.3 < alpha.mean() < 0.7  # gates start uninformative


@pytest.mark.parametrize("kind, gate", [("factorengram", "basis"), ("factorengram", "scalar"),
                                        ("factorengram", "none"), ("engram", "scalar"), ("engram", "none")])
def test_causality(kind, gate):
    cfg = small_config(kind=kind, gate=gate, memory_dim=24 if kind == "engram" else 12)
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


@pytest.mark.parametrize("kind, gate, placement", [
    ("factorengram", "basis", "before_attn"), ("factorengram", "scalar", "before_ffn"),
    ("factorengram", "none", "inside_ffn"), ("engram", "scalar", "before_attn"), ("engram", "none", "inside_ffn")])
def test_every_variant_runs_forward_and_backward(kind, gate, placement):
    cfg = small_config(kind=kind, gate=gate, placement=placement, memory_dim=24 if kind == "engram" else 12)
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


def test_wrong_kind_for_class():
    with pytest.raises(ValueError, match="FactorEngram needs MemoryConfig.kind='factorengram', got 'engram'"):
        FactorEngram(small_config(kind="engram", gate="scalar", memory_dim=24), 1)
    with pytest.raises(ValueError, match="Engram needs MemoryConfig.kind='engram', got 'factorengram'"):
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


@pytest.mark.parametrize("overrides", [
    dict(), dict(gate="scalar"), dict(gate="none"), dict(placement="inside_ffn"),
    dict(kind="engram", gate="scalar", memory_dim=24), dict(kind="engram", gate="none", memory_dim=24),
    dict(gate="scalar", table_dtype="fp8"), dict(kind="engram", gate="scalar", memory_dim=24, table_dtype="fp8")])
def test_sharding_plan_has_an_entry_for_every_parameter(overrides):
    """Adding a parameter without saying how the layouts split it fails here."""
    from fe_megatron.memory.sharding import SHARDING_PLAN, local_shape

    cfg = small_config(**overrides)
    module = build_memory(cfg, 1)
    plan = SHARDING_PLAN[cfg.kind]
    assert set(dict(module.named_parameters())) <= set(plan)
    if cfg.gate == "scalar" and cfg.table_dtype == "fp8":  # the variant with every parameter (fp8: row scales)
        assert set(dict(module.named_parameters())) == set(plan)
    for name, param in module.named_parameters():
        assert module.global_shape(name) == tuple(param.shape)  # one process holds the global shapes
        dim = plan[name].tensor_parallel_dim
        expected = list(param.shape)
        if dim is not None:
            expected[dim] //= 2
        assert local_shape(cfg.kind, name, tuple(param.shape), 2) == tuple(expected)


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
