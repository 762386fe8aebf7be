"""The fused branch's kernels (`fe_megatron.ops`, "the fused branch") against their unfused references: the
basis-gated reconstruction (Eq. 7-9) forward and backward, and what its backward keeps from the forward; a served step's
position-wise memory in one call; a decoding step's refinement (Eq. 10).

Contract (docs/kernels.md, "The fused branch"): in fp32 within 1e-5 of the largest value of the float64
reference; in bf16 no further from the float64 reference than twice the unfused bf16 composition is, or two of bf16's
rounding units (2^-8 of the largest value), whichever is more. On CPU the
Triton kernels run in the interpreter (small shapes); on a GPU the same tests run them compiled.
"""

import math

import pytest
import torch

from fe_megatron import ops
from fe_megatron.memory import FactorEngram
from fe_megatron.ngram import NgramHasher
from fe_megatron.ops import reference
from tests.helpers.configs import small_config
from tests.helpers.kernels import COMPILED, device_of, small

BF16_UNIT = 2.0 ** -8  # bf16's relative rounding unit
SHAPES = [  # (positions, s, d_m, hidden size): below a tile, across tiles' edges, the demo's widths
    (5, 24, 16, 32),
    (67, 72, 40, 128),
    (300, 192, 128, 128),
]


def operands(positions, width, memory_dim, dtype, device, generator):
    """Fresh random z, q (unit-scale, as RMSNorm leaves it), D at its initial scale (N(0, 1/s)), and dL/de."""
    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype).to(device)
    return (draw(positions, width), draw(positions, memory_dim), draw(width, memory_dim, scale=width ** -0.5),
            draw(positions, memory_dim))


def relative_error(result, exact):
    return float((result.double().cpu() - exact.cpu()).abs().max() / exact.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", COMPILED)
def test_the_kernels_follow_the_reference_forward_and_backward(backend, dtype):
    device = device_of(backend)
    kernels = ops.get_backend(ops.gated_reconstruction_backend(device, dtype) if backend == "cuda" else backend)
    generator = torch.Generator().manual_seed(3)
    shapes = SHAPES if small(backend, 1, 0) else SHAPES[:2]
    for positions, width, memory_dim, hidden_size in shapes:
        z, q, d, grad = operands(positions, width, memory_dim, dtype, device, generator)
        exact = [reference.gated_reconstruction_forward(*(t.double() for t in (z, q, d)), hidden_size),
                 *reference.gated_reconstruction_backward(*(t.double() for t in (grad, z, q, d)), hidden_size)]
        fused = [kernels.module.gated_reconstruction_forward(z, q, d, hidden_size),
                 *kernels.module.gated_reconstruction_backward(grad, z, q, d, hidden_size)]
        unfused = [reference.gated_reconstruction_forward(z, q, d, hidden_size),
                   *reference.gated_reconstruction_backward(grad, z, q, d, hidden_size)]
        for name, result, unfused_result, value in zip(("e", "dL/dz", "dL/dq", "dL/dD"), fused, unfused, exact):
            assert result.shape == value.shape and result.dtype == dtype, name
            error = relative_error(result, value)
            bound = 1e-5 if dtype == torch.float32 else 2 * max(relative_error(unfused_result, value), BF16_UNIT)
            assert error <= bound, (f"{backend} {dtype} {name} at (M, s, d_m) = {(positions, width, memory_dim)}: "
                                    f"{error:.2e} from the float64 reference, bound {bound:.2e}")


@pytest.mark.parametrize("backend", COMPILED)
def test_autograd_through_the_operator_equals_the_unfused_branch(backend):
    """[batch, seq, s] inputs through `ops.gated_reconstruction` (the operator and its autograd formula) and through
    the reference composition give the same output and gradients; a dictionary's row shards (tensor parallelism)
    sum to the whole."""
    device = device_of(backend)
    generator = torch.Generator().manual_seed(5)
    z, q, d, _ = operands(2 * small(backend, 40, 9), 48, 32, torch.float32, device, generator)
    z, q = z.view(2, -1, 48), q.view(2, -1, 32)
    results = {}
    for name in ("torch", backend):
        leaves = [t.clone().requires_grad_() for t in (z, q, d)]
        with ops.use_backend(name):
            memory = ops.gated_reconstruction(*leaves, 64)
        grad = torch.randn(memory.shape, generator=torch.Generator().manual_seed(6)).to(device)
        memory.backward(grad)
        results[name] = [memory.detach(), *(leaf.grad for leaf in leaves)]
    for name, fused, unfused in zip(("e", "dL/dz", "dL/dq", "dL/dD"), results[backend], results["torch"]):
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5 * float(unfused.abs().max()), msg=name)
    with ops.use_backend(backend), torch.no_grad():
        shards = sum(ops.gated_reconstruction(z[..., rows], q, d[rows], 64) for rows in (slice(0, 24), slice(24, 48)))
    torch.testing.assert_close(shards, results["torch"][0], rtol=1e-5, atol=1e-5)


def saved_bytes_per_position(branch, hidden, ids) -> float:
    """Bytes of the distinct tensors autograd keeps from ``branch``'s forward for its backward, per position
    (parameters excluded: they are there anyway)."""
    parameters = {param.untyped_storage().data_ptr() for param in branch.parameters()}
    storages = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        memory, l1 = branch(hidden, ids)
    (memory.sum() + l1.sum()).backward()
    return sum(storages.values()) / ids.numel()


def test_the_fused_branch_keeps_two_s_wide_activations_less_per_position():
    """The unfused basis gate keeps the gate ``alpha`` and the gated coefficients ``z * alpha`` ([.., s] each) for
    its backward; the fused operator keeps neither (its backward recomputes the gate)."""
    device = device_of("cpp")
    config = small_config(coeff_width=96, memory_dim=32, hidden_size=64)
    torch.manual_seed(0)
    branch = FactorEngram(config, config.layers[0]).to(device)
    hidden = torch.randn(2, 16, 64, device=device, requires_grad=True)
    ids = torch.randint(0, config.vocab_size, (2, 16), device=device)
    saved = {}
    for name in ("torch", "cpp"):
        with ops.use_backend(name):
            saved[name] = saved_bytes_per_position(branch, hidden, ids)
    s_wide = config.coeff_width * 4  # one fp32 [.., s] tensor per position
    assert saved["torch"] - saved["cpp"] == pytest.approx(2 * s_wide), saved


def test_bad_operands_are_named_and_other_dtypes_take_the_reference():
    z, q, d = torch.randn(4, 12), torch.randn(4, 8), torch.randn(12, 8)
    with pytest.raises(ValueError, match=r"coefficients \[..., s\], query \[..., d_m\] and dictionary \[s, d_m\], "
                                         r"got \(4, 12\), \(4, 7\) and \(12, 8\)"):
        ops.gated_reconstruction(z, q[:, :7], d, 16)
    with pytest.raises(ValueError, match=r"got \(4, 12\), \(3, 8\)"):
        ops.gated_reconstruction(z, q[:3], d, 16)
    assert ops.gated_reconstruction_backend(torch.device("cpu"), torch.float64) == "torch"
    exact = ops.gated_reconstruction(z.double(), q.double(), d.double(), 16)
    torch.testing.assert_close(exact, reference.gated_reconstruction(z.double(), q.double(), d.double(), 16))
    if "cpp" in ops.available_backends():
        with pytest.raises(RuntimeError, match=r"coefficients \[M, s\], query \[M, d_m\] and dictionary \[s, d_m\]"):
            ops.get_backend("cpp").module.gated_reconstruction_forward(z, q, d[:11], 16)
        assert math.isfinite(float(ops.get_backend("cpp").module.gated_reconstruction_forward(
            z * 1e4, q * 1e4, d, 16).abs().max()))  # a saturated gate stays finite


def served_operands(dtype, generator):
    def draw(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale + shift).to(dtype)
    return (draw(9, 64), draw(9, 96), draw(32, 64, scale=0.1), draw(32, scale=0.1, shift=1.0), draw(96, 32,
            scale=96 ** -0.5), draw(48, 32, scale=0.1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_served_step_s_memory_in_one_call_follows_its_modules(dtype):
    """`ops.basis_memory_values` (Q, RMSNorm, the gate, D^T and V in one C++ call) against the reference composition;
    a branch's `values` in one call equals its modules' forward, with gradients and without."""
    device = device_of("cpp")
    generator = torch.Generator().manual_seed(8)
    hidden, z, query_weight, norm_weight, dictionary, value_weight = served_operands(dtype, generator)
    args = (hidden, z, query_weight, norm_weight, 1e-5, dictionary, value_weight, 64)
    exact = reference.basis_memory_values(*(a.double() if isinstance(a, torch.Tensor) else a for a in args))
    unfused = reference.basis_memory_values(*args)
    fused = ops.get_backend("cpp").module.basis_memory_values(*args)
    bound = 1e-5 if dtype == torch.float32 else 2 * max(relative_error(unfused, exact), BF16_UNIT)
    assert relative_error(fused, exact) <= bound
    config = small_config(coeff_width=96, memory_dim=32, hidden_size=64)
    branch = FactorEngram(config, config.layers[0]).to(device=device, dtype=dtype)
    torch.nn.init.normal_(branch.value_proj.weight, std=0.1)
    hidden = hidden.view(3, 3, 64).to(device)
    with torch.no_grad():
        assert branch._values_in_one_call()
        with ops.use_fused_branch(False):
            assert not branch._values_in_one_call()
            expected = branch.values(hidden, z.view(3, 3, 96))
        fused_values = branch.values(hidden, z.view(3, 3, 96))
    assert not branch._values_in_one_call()  # gradients on: the modules, and the fused operator with autograd
    with_grad = branch.values(hidden, z.view(3, 3, 96))
    # bit for bit the forward with gradients (a reentrant activation checkpoint's two passes), and close to unfused
    torch.testing.assert_close(fused_values, with_grad.detach(), rtol=0, atol=0)
    assert relative_error(fused_values, expected.double()) <= (1e-5 if dtype == torch.float32 else 2 * BF16_UNIT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel, dilation", [(4, 3), (3, 1), (1, 1)])
def test_a_decoding_step_s_refinement_follows_the_reference_and_advances_the_state_alike(kernel, dilation, dtype):
    device = device_of("cpp")
    generator = torch.Generator().manual_seed(kernel * 10 + dilation)
    history, channels = (kernel - 1) * dilation, 48
    values = torch.randn(5, channels, generator=generator).to(dtype)
    state = torch.randn(8, max(1, history) + 2, channels, generator=generator).to(dtype)  # room for drafts, unread
    slots = torch.tensor([3, 0, 7, 1, 5])
    norm_weight = (1 + 0.1 * torch.randn(channels, generator=generator)).to(dtype)
    conv_weight = torch.randn(channels, kernel, generator=generator).to(dtype)
    states = [state.clone().to(device), state.clone().to(device)]
    expected = reference.short_conv_decode_(values, states[0], slots, norm_weight, conv_weight, dilation, 1e-5)
    fused = ops.short_conv_decode_(values, states[1], slots, norm_weight, conv_weight, dilation, 1e-5)
    torch.testing.assert_close(fused, expected, rtol=1e-5 if dtype == torch.float32 else 0.0,
                               atol=1e-5 if dtype == torch.float32 else 0.0)  # bf16: its roundings, one by one
    torch.testing.assert_close(states[1], states[0], rtol=0, atol=0)
    untouched = [slot for slot in range(8) if slot not in slots.tolist()]
    torch.testing.assert_close(states[1][untouched], state[untouched], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"slot 9 of request 1 is outside the state's 8 slots"):
        ops.short_conv_decode_(values, states[1], torch.tensor([3, 9, 7, 1, 5]), norm_weight, conv_weight, dilation,
                               1e-5)


@pytest.mark.parametrize("state_dtype", [torch.int64, torch.int32])
def test_a_decoding_step_s_addresses_follow_the_whole_sequence_s_hash(state_dtype):
    """`ops.ngram_hash_decode_` token by token (generate's int64 state, vLLM's int32 one) gives the rows that the
    hash of the whole sequence gives, and the same as the reference, state and all."""
    device_of("cpp")
    config = small_config(ngram_orders=[1, 2, 3])
    hasher = NgramHasher(config)
    generator = torch.Generator().manual_seed(11)
    ids = hasher.lookup_ids(torch.randint(0, config.vocab_size, (4, 9), generator=generator))
    expected = hasher.indices_of_lookup_ids(ids)
    slots = torch.tensor([2, 0, 5, 3])
    states = [torch.full((6, config.max_order - 1 + 1), hasher.pad_id, dtype=state_dtype) for _ in range(2)]
    for position in range(ids.shape[1]):
        fused = hasher.indices_of_next_ids(ids[:, position], states[0], slots)
        with ops.use_backend("torch"):
            unfused = hasher.indices_of_next_ids(ids[:, position], states[1], slots)
        torch.testing.assert_close(fused, expected[:, position], rtol=0, atol=0)
        torch.testing.assert_close(unfused, fused, rtol=0, atol=0)
        torch.testing.assert_close(states[0], states[1], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"slot 6 of request 0 is outside the state's 6 slots"):
        hasher.indices_of_next_ids(ids[:, 0], states[0], torch.tensor([6, 0, 5, 3]))
