"""What every memory branch (`fe_megatron.memory.branch`) does: it starts as the identity and learns, is
causal, sends gradients to exactly the rows it read, runs in every variant and in bf16, and refuses
bad inputs by name."""

import math

import pytest
import torch

from fe_megatron.memory import Engram, FactorEngram, build_memory
from tests.helpers.configs import small_config
from tests.helpers.memory import randomize


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
