"""Every kernel backend against the torch reference (`fe_megatron.ops.reference`).

Contract (docs/kernels.md): hash indices and gathered values are bit-identical; table
gradients agree within 1e-6 relative in fp32; bf16 gradients within one bf16 rounding
(Triton's interpreter truncates on fp32 -> bf16 stores where torch rounds to nearest even).
On CPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1), so
their cases are kept small; on a GPU the same tests cover the cuda and triton backends.
"""

import inspect
import logging
import random
import sys
import textwrap

import pytest
import torch

from fe_megatron import ops
from fe_megatron.config import MemoryConfig
from fe_megatron.memory import FactorEngram
from fe_megatron.ngram import NgramHasher
from fe_megatron.ops import reference
from tests.helpers.configs import small_config
from tests.helpers.hashing import GOLDEN_CONFIG, GOLDEN_IDS, GOLDEN_INDICES
from tests.helpers.kernels import (COMPILED, CUDA, device_of, duplicate_heavy_indices, intra_op_threads, small,
                                   two_microbatches_of_a_table)

def random_hash_constants(branches: int, window: int, vocab: int, device):
    """Branches of random orders: odd multipliers below the int64-safe bound, zero past the order."""
    bound = (2 ** 63 - 1) // (vocab + 1)
    mult = torch.zeros(branches, window, dtype=torch.int64)
    for b in range(branches):
        for k in range(random.randint(1, window)):
            mult[b, k] = random.randrange(1, bound) | 1
    moduli = torch.tensor([random.randint(vocab, 50 * vocab) for _ in range(branches)])
    offsets = torch.cumsum(moduli, 0) - moduli
    return mult.to(device), moduli.to(device), offsets.to(device)


def test_cpp_backend_is_built():
    assert "cpp" in ops.available_backends(), (
        "fe_megatron.ops._C_cpu is missing: install with `pip install --no-build-isolation -e .` where torch is "
        "installed")
    assert ops.available_backends()[0] == "torch"
    assert set(ops.available_backends()) <= set(ops.BACKEND_NAMES)


def test_triton_kernels_read_only_constexpr_globals():
    """Triton's compiler refuses a @triton.jit function that reads a plain module global (its CPU
    interpreter accepts one): every global a kernel reads is tl.constexpr, a kernel, or a module."""
    import ast
    import types

    triton = pytest.importorskip("triton", reason="Triton is not installed")
    from triton.runtime.interpreter import InterpretedFunction  # what triton.jit gives under TRITON_INTERPRET=1
    from triton.runtime.jit import JITFunction

    from fe_megatron.ops import triton_backend

    kernel_types = (JITFunction, InterpretedFunction)
    module_globals = vars(triton_backend)
    kernels = {name: value for name, value in module_globals.items() if isinstance(value, kernel_types)}
    assert len(kernels) >= 5, f"fe_megatron.ops.triton_backend's @triton.jit functions: {sorted(kernels)}"
    for name, kernel in kernels.items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in module_globals:
                value = module_globals[node.id]
                assert isinstance(value, (triton.language.constexpr, *kernel_types, types.ModuleType)), (
                    f"triton_backend.{name} reads the global {node.id} = {value!r}: make it tl.constexpr(...)")


def test_default_is_fastest_and_use_backend_forces_and_restores():
    cpu = torch.device("cpu")
    assert ops.current_backend(cpu) == "cpp"
    with ops.use_backend("torch"):
        assert ops.current_backend(cpu) == "torch"
        with ops.use_backend("cpp"):
            assert ops.current_backend(cpu) == "cpp"
        assert ops.current_backend(cpu) == "torch"
    assert ops.current_backend(cpu) == "cpp"
    with pytest.raises(ValueError, match="kernel backend 'fortran' is not available here; known backends: "
                                         r"\('torch', 'cpp', 'cuda', 'triton'\). Available: \['torch'"):
        with ops.use_backend("fortran"):
            pass


def test_the_chosen_backend_is_the_process_s_and_the_backward_keeps_the_forward_s(monkeypatch):
    """`set_backend` holds in every thread (autograd's backward thread, the host tier's worker);
    a gather's backward runs its forward's backend, even after a `use_backend` block has ended."""
    import threading

    cpu, seen = torch.device("cpu"), []
    try:
        ops.set_backend("torch")
        worker = threading.Thread(target=lambda: seen.append(ops.current_backend(cpu)))
        worker.start()
        worker.join()
        assert seen == ["torch"]
        ops.set_backend("auto")
        assert ops.current_backend(cpu) == "cpp"
    finally:
        ops.set_backend(None)
    calls = []
    cpp = ops.get_backend("cpp").module
    counted = type("Counted", (), {
        "gather_rows_forward": staticmethod(cpp.gather_rows_forward),
        "gather_rows_backward": staticmethod(lambda *a: (calls.append("cpp"), cpp.gather_rows_backward(*a)))})
    monkeypatch.setitem(ops._backends, "cpp", ops.Backend("cpp", counted, ("cpu",)))
    weight = torch.randn(16, 4, requires_grad=True)
    with ops.use_backend("cpp"):
        rows = ops.gather_rows(weight, torch.randint(0, 16, (5, 2)))
    with ops.use_backend("torch"):
        rows.square().sum().backward()
    assert calls == ["cpp"] and weight.grad is not None and weight.grad.abs().sum() > 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device to check device refusal of the cpp backend")
def test_forced_backend_refuses_other_device():
    with ops.use_backend("cpp"), pytest.raises(ValueError, match="cannot run on cuda tensors"):
        ops.gather_rows(torch.randn(4, 2, device="cuda"), torch.zeros(3, 1, dtype=torch.int64, device="cuda"))


def test_no_compiled_backend_logs_one_line(monkeypatch, caplog):
    monkeypatch.setattr(ops, "_backends", {"torch": ops._backends["torch"]})
    monkeypatch.setattr(ops, "_discovered", False)
    monkeypatch.setitem(sys.modules, "fe_megatron.ops._C_cpu", None)  # import fails as if never built
    monkeypatch.setitem(sys.modules, "fe_megatron.ops._C_cuda", None)
    with caplog.at_level(logging.WARNING, logger="fe_megatron.ops"):
        assert "cpp" not in ops.available_backends() and "cuda" not in ops.available_backends()
        ops.available_backends()  # asked again: no second line
    lines = [r.getMessage() for r in caplog.records if r.name == "fe_megatron.ops"]
    assert len(lines) == 1 and "no compiled kernels are built" in lines[0] and "torch reference" in lines[0]
    assert ops.current_backend(torch.device("cpu")) == "torch"


@pytest.mark.parametrize("backend", ("torch",) + COMPILED)
def test_hash_matches_reference(backend):
    device = device_of(backend)
    for _ in range(4):
        window, vocab = random.randint(1, 4), random.randint(2, 70_000)
        batch, seq = random.randint(1, 3), random.choice([1, window - 1 or 1, random.randint(2, 300)])
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        constants = random_hash_constants(random.randint(1, 30), window, vocab, device)
        expected = reference.ngram_hash(ids, *constants, vocab)
        with ops.use_backend(backend):
            got = ops.ngram_hash(ids, *constants, vocab)
        assert got.dtype == torch.int64 and torch.equal(got, expected)


@pytest.mark.parametrize("backend", ("torch",) + COMPILED)
def test_hash_golden_vectors_and_all_layers_in_one_launch(backend):
    device = device_of(backend)
    config = MemoryConfig(**GOLDEN_CONFIG)
    with ops.use_backend(backend):
        got = NgramHasher(config).indices(torch.tensor(GOLDEN_IDS, device=device))
        per_layer = NgramHasher(config).indices_per_layer(torch.tensor(GOLDEN_IDS, device=device))
    assert got.cpu().tolist() == GOLDEN_INDICES
    assert torch.equal(torch.cat([per_layer[layer] for layer in config.layers], -1), got)


@pytest.mark.parametrize("backend", ("torch",) + COMPILED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_forward_bit_identical(backend, dtype):
    device = device_of(backend)
    for width in (24, 37, 256):  # ragged column blocks
        rows = random.randint(50, 400)
        count = small(backend, random.randint(3000, 9000), random.randint(300, 900))  # ragged last block
        weight = torch.randn(rows, width, device=device).to(dtype)
        indices = torch.randint(0, rows, (count,), device=device)
        with ops.use_backend(backend):
            got = ops.gather_rows(weight, indices.view(-1, 1))
        assert got.shape == (count, 1, width) and torch.equal(got.view(count, width), weight[indices])


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_table_backward_matches_reference(backend, grad_dtype, out_dtype, deterministic):
    device = device_of(backend)
    rows, width = random.randint(40, 300), random.choice([24, 40])
    count = small(backend, random.randint(5000, 20000), random.randint(400, 700))
    indices = duplicate_heavy_indices(rows, count, device)
    grad_rows = torch.randn(count, width, device=device).to(grad_dtype)
    start = torch.randn(rows, width, device=device).to(out_dtype)  # accumulate into a non-zero buffer
    expected, got = start.clone(), start.clone()
    reference.gather_rows_backward(grad_rows, indices, expected)
    ops.get_backend(backend).module.gather_rows_backward(grad_rows, indices, got, deterministic)
    if out_dtype == torch.float32 and device.type == "cuda":
        # on a GPU the reference's index_add_ (and the atomic path) sum a row's duplicates in any order,
        # and the sorted path in chunks: each row is compared with its exact sum, within fp32 rounding
        # of an n-term sum, which grows like sqrt(n) with the row's duplicates n
        exact = start.double().index_add_(0, indices, grad_rows.double())
        duplicates = torch.bincount(indices, minlength=rows).double().clamp(min=1)[:, None]
        bound = 1e-6 * exact.abs() + 1e-6 * float(exact.abs().max()) * duplicates.sqrt()
        excess = ((got.double() - exact).abs() - bound).max()
        assert excess <= 0, f"a row's gradient is off its exact sum by {float(excess):.3g} beyond fp32 rounding"
    elif out_dtype == torch.float32:
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * scale)
    else:  # bf16: the fp32 sums agree; the stored value may differ by one bf16 rounding step
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-6)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[indices.cpu()] = False
    assert torch.equal(got[untouched.to(device)], start[untouched.to(device)])


def test_cpp_fp32_backward_is_bit_identical_to_the_cpu_reference():
    """fp32 on CPU: rows are partitioned over threads (4 here, whatever the test process's count) and summed
    in position order, which is the reference's sequential order, so building the extension changes no bit."""
    rows, width, count = 300, 40, 20000
    indices = duplicate_heavy_indices(rows, count, "cpu")
    grad_rows = torch.randn(count, width)
    start = torch.randn(rows, width)
    expected, got = start.clone(), start.clone()
    reference.gather_rows_backward(grad_rows, indices, expected)
    with intra_op_threads(4):
        ops.get_backend("cpp").module.gather_rows_backward(grad_rows, indices, got, True)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", COMPILED)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_deterministic_backward_repeats_bit_for_bit(backend, out_dtype):
    device = device_of(backend)
    rows, width, count = 60, 24, small(backend, 8000, 500)
    indices = duplicate_heavy_indices(rows, count, device)
    grad_rows = torch.randn(count, width, device=device)
    outs = [torch.zeros(rows, width, dtype=out_dtype, device=device) for _ in range(2)]
    for out, threads in zip(outs, (4, 3)):  # on the host: other partitions of the rows, the same bits
        with intra_op_threads(threads):
            ops.get_backend(backend).module.gather_rows_backward(grad_rows, indices, out, True)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not CUDA, reason="the cuda and triton sorted reductions are compared on a GPU")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cuda_and_triton_sum_in_the_same_order(out_dtype):
    for backend in ("cuda", "triton"):
        device_of(backend)
    rows, width, count = 500, 256, 200_000
    indices = duplicate_heavy_indices(rows, count, "cuda")
    grad_rows = torch.randn(count, width, device="cuda")
    outs = {}
    for backend in ("cuda", "triton"):
        outs[backend] = torch.zeros(rows, width, dtype=out_dtype, device="cuda")
        ops.get_backend(backend).module.gather_rows_backward(grad_rows, indices, outs[backend], True)
    assert torch.equal(outs["cuda"], outs["triton"])


@pytest.mark.parametrize("backend", COMPILED)
def test_autograd_gradient_of_a_table(backend):
    """Two microbatches' dense gradients add up to the reference's (Megatron's accumulation into
    ``main_grad`` is the adapter's: tests/unit/megatron/test_main_grad.py)."""
    weight, backward, expected = two_microbatches_of_a_table(backend, device_of(backend))
    backward()
    torch.testing.assert_close(weight.grad, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("backend", COMPILED)
def test_factorengram_steps_match_reference_backend(backend):
    """Outputs, every gradient and the parameters after three Adam steps of a whole
    FactorEngram branch, kernels against the torch reference."""
    device = device_of(backend)
    config = small_config()
    results = []
    for name in ("torch", backend):
        torch.manual_seed(0)
        branch = FactorEngram(config, config.layers[0]).to(device)
        torch.nn.init.normal_(branch.value_proj.weight, std=0.1)  # so that gradients reach the tables
        optimizer = torch.optim.Adam(branch.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(1)
        outputs, grads = [], None
        with ops.use_backend(name):
            for _ in range(3):
                h = torch.randn(2, small(backend, 48, 16), config.hidden_size, generator=generator).to(device)
                ids = torch.randint(0, config.vocab_size, h.shape[:2], generator=generator).to(device)
                optimizer.zero_grad()
                memory, l1 = branch(h, ids)
                (memory.square().sum() + 1e-2 * l1.sum()).backward()
                outputs.append(memory.detach())
                grads = grads or {n: p.grad.clone() for n, p in branch.named_parameters()}
                optimizer.step()
        results.append((outputs, grads, {n: p.detach().clone() for n, p in branch.named_parameters()}))
    (out_a, grad_a, param_a), (out_b, grad_b, param_b) = results
    for a, b in zip(out_a, out_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for name in grad_a:
        torch.testing.assert_close(grad_b[name], grad_a[name], rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")
        torch.testing.assert_close(param_b[name], param_a[name], rtol=1e-5, atol=1e-6, msg=f"{name} after 3 steps")


@pytest.mark.parametrize("backend", ("torch",) + COMPILED)
@pytest.mark.parametrize("bad", [-1, 300])
def test_out_of_range_index_is_a_clear_error_in_debug_mode(backend, bad):
    device = device_of(backend)
    weight = torch.randn(300, 8, device=device, requires_grad=True)
    indices = torch.randint(0, 300, (2, 5, 3), device=device)
    indices[1, 3, 2] = bad
    with ops.use_backend(backend), ops.debug_checks():
        with pytest.raises(ValueError, match=rf"row index {bad} at position \(1, 3, 2\) of the indices "
                                             rf"\(shape \(2, 5, 3\)\) is outside the table's rows \[0, 300\)"):
            ops.gather_rows(weight, indices)


# three tests, so that a crash (seen once on a GPU machine) names the path that crashed
@pytest.mark.parametrize("bad", [-3, 10])
def test_cpp_forward_checks_ranges_without_debug_mode(bad):
    device_of("cpp")
    with pytest.raises(RuntimeError, match=rf"gather_rows: row index {bad} at flat position 1 is outside the "
                                           r"table's rows \[0, 10\)"):
        ops.get_backend("cpp").module.gather_rows_forward(torch.randn(10, 4), torch.tensor([1, bad, 2]))


@pytest.mark.parametrize("bad", [-3, 10])
def test_cpp_checks_ranges_through_the_operator_without_debug_mode(bad):
    indices = torch.tensor([[1], [bad], [2]])
    with ops.use_backend("cpp"), pytest.raises(RuntimeError, match=rf"row index {bad} at flat position 1 is "
                                                                   r"outside the table's rows \[0, 10\)"):
        ops.gather_rows(torch.randn(10, 4), indices)


@pytest.mark.parametrize("bad", [-3, 10])
def test_cpp_backward_checks_ranges_and_leaves_the_gradient(bad):
    device_of("cpp")
    out = torch.randn(10, 4)
    before = out.clone()
    with pytest.raises(RuntimeError, match=rf"gather_rows backward: row index {bad} at flat position 1 is outside "
                                           r"the table's rows \[0, 10\)"):
        ops.get_backend("cpp").module.gather_rows_backward(torch.randn(3, 4), torch.tensor([1, bad, 2]), out, True)
    assert torch.equal(out, before), "a refused backward left the gradient as it was"


def test_bad_dtypes_and_shapes_are_named():
    with pytest.raises(TypeError, match="gather_rows: indices must be int64, got torch.int32"):
        ops.gather_rows(torch.randn(4, 2), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"weight must be \[rows, width\], got shape \(4,\)"):
        ops.gather_rows(torch.randn(4), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="ngram_hash: moduli must be int64"):
        ops.ngram_hash(torch.zeros(1, 2, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int64),
                       torch.ones(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), 5)
    with pytest.raises(ValueError, match=r"moduli and offsets \[nb\]"):
        ops.ngram_hash(torch.zeros(1, 2, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int64),
                       torch.ones(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 5)


@pytest.mark.parametrize("backend", ["torch", "cpp", "cuda", "triton"])
def test_table_beyond_2_to_the_31_elements(backend):
    """Offsets are int64: rows past element 2^31 are read and written correctly.
    The table is allocated but never filled, so only the touched pages cost memory."""
    device = device_of(backend)
    if backend == "triton" and device.type == "cpu":
        pytest.skip("Triton's interpreter copies whole tensors; the >2^31-element table is checked on GPU")
    width = 256
    rows = (1 << 31) // width + 1000
    weight = torch.empty(rows, width, dtype=torch.bfloat16, device=device)
    indices = torch.tensor([rows - 1, 5, rows - 1000, rows - 1], device=device)
    weight[indices] = torch.randn(len(indices), width, device=device).to(torch.bfloat16)
    kernels = ops.get_backend(backend).module
    assert torch.equal(kernels.gather_rows_forward(weight, indices), weight[indices])
    grad = torch.randn(len(indices), width, device=device).to(torch.bfloat16)
    touched = indices.unique()
    weight[touched] = 0
    kernels.gather_rows_backward(grad, indices, weight, True)
    expected = torch.zeros(len(touched), width, device=device)
    expected.index_add_(0, torch.searchsorted(touched, indices), grad.float())
    torch.testing.assert_close(weight[touched].float(), expected.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_float64_tables_use_the_reference_and_forcing_them_is_refused():
    weight = torch.randn(20, 4, dtype=torch.float64)
    assert ops.current_backend(weight.device, weight.dtype) == "torch"
    assert ops.current_backend(weight.device, torch.float32) == "cpp"
    with ops.use_backend("cpp"), pytest.raises(TypeError, match="backend 'cpp' .* does not take torch.float64 tables"):
        ops.gather_rows(weight, torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="weight must be float32, bfloat16 or float16"):
        ops.get_backend("cpp").module.gather_rows_forward(weight, torch.zeros(2, dtype=torch.int64))


def test_backward_runs_on_the_backend_of_its_forward(monkeypatch):
    """On a GPU autograd runs the backward on its own thread, where use_backend is not in
    force; the backward must still use the backend its forward used."""
    calls = []

    class Spy:
        ngram_hash = staticmethod(reference.ngram_hash)
        gather_rows_forward = staticmethod(reference.gather_rows_forward)

        @staticmethod
        def gather_rows_backward(*args):
            calls.append("spy")
            reference.gather_rows_backward(*args)

    monkeypatch.setitem(ops._backends, "cuda", ops.Backend("cuda", Spy, ("cpu",)))
    weight = torch.randn(10, 4, requires_grad=True)
    with ops.use_backend("cuda"):
        rows = ops.gather_rows(weight, torch.randint(0, 10, (5, 2)))
    assert ops.current_backend(weight.device) == "cpp"  # outside the block the default is back
    rows.sum().backward()
    assert calls == ["spy"]


# ----------------------------------------------------------------------------- the table optimizer's update
@pytest.mark.parametrize("backend", ("cpp", "triton"))
@pytest.mark.parametrize("param_dtype,grad_dtype,state_dtype", [
    (torch.bfloat16, torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32, torch.bfloat16)])
def test_fused_table_update_matches_the_reference(backend, param_dtype, grad_dtype, state_dtype):
    """The fused AdamW step against the reference's blocks: fp32 results within one fp32 rounding
    of an intermediate, bf16 ones equal but where that rounding moved the stochastic rounding's
    threshold (one bf16 step, in under one element in ten thousand)."""
    device = device_of(backend)
    rows, width = 5000, 48
    values = [torch.randn(rows, width) for _ in range(2)] + [torch.randn(rows, width) * 0.1,
                                                              torch.rand(rows, width) * 0.1]
    dtypes = (param_dtype, grad_dtype, state_dtype, state_dtype)
    global_rows = torch.randperm(3 * rows)[:rows]  # a shard's rows, scattered in the whole table
    keys = torch.randint(0, 2 ** 31, (3, 2))
    results = {}
    for name in ("torch", backend):
        p, g, m, v = (t.to(dtype).to(device).clone() for t, dtype in zip(values, dtypes))  # each run its own copy
        ops.table_adamw_(p, g, m, v, global_rows, 7, 3 * width, keys, 1e-2, 0.9, 0.95, 1e-8, 0.01, step=5,
                         backend=name)
        results[name] = (p, m, v)
    for name, ours, theirs in zip(("param", "exp_avg", "exp_avg_sq"), results[backend], results["torch"]):
        ours, theirs = ours.float().cpu(), theirs.float().cpu()
        if ours.dtype == torch.float32 and (param_dtype if name == "param" else state_dtype) == torch.float32:
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=name)
            continue
        moved = ours != theirs
        assert moved.float().mean() < 1e-4, f"{name}: {int(moved.sum())} of {moved.numel()} elements differ"
        step = theirs[moved].abs() * 2.0 ** -7  # one bf16 step at their magnitude (8 significant bits)
        assert ((ours[moved] - theirs[moved]).abs() <= step * 1.01).all(), name


@pytest.mark.parametrize("param_dtype,state_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                     (torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
def test_triton_table_update_equals_the_cpp_kernel_bit_for_bit(param_dtype, state_dtype):
    """Same order of operations, IEEE division and square root, no contraction but lerp's fma:
    the Triton update (compiled on a GPU, interpreted on CPU) writes the C++ kernel's bits, inf
    kept and nan kept nan."""
    device, _ = device_of("triton"), device_of("cpp")
    rows, width = 700, 40
    values = [torch.randn(rows, width), torch.randn(rows, width), torch.randn(rows, width) * 0.1,
              torch.rand(rows, width) * 0.1]
    values[0][0, 0], values[0][1, 1] = float("inf"), float("nan")
    dtypes = (param_dtype, torch.float32, state_dtype, state_dtype)
    global_rows, keys = torch.randperm(5 * rows)[:rows], torch.randint(0, 2 ** 31, (3, 2))
    results = {}
    for backend, where in (("cpp", "cpu"), ("triton", device)):
        p, g, m, v = (t.to(dtype).to(where).clone() for t, dtype in zip(values, dtypes))  # each run its own copy
        ops.table_adamw_(p, g, m, v, global_rows, 3, 2 * width, keys, 3e-3, 0.9, 0.95, 1e-8, 0.1, step=7,
                         backend=backend)
        results[backend] = [t.cpu() for t in (p, m, v)]
    for name, ours, theirs in zip(("param", "exp_avg", "exp_avg_sq"), results["triton"], results["cpp"]):
        both_nan = ours.isnan() & theirs.isnan()  # the payload of a nan may differ
        bits = torch.int16 if ours.dtype == torch.bfloat16 else torch.int32
        differ = (ours.view(bits) != theirs.view(bits)) & ~both_nan
        assert not differ.any(), f"{name}: {int(differ.sum())} elements differ, first at {differ.nonzero()[0].tolist()}"
    assert results["triton"][0][0, 0] == float("inf") and bool(results["triton"][0][1, 1].isnan())


def test_a_backend_without_a_fused_update_takes_the_fastest_one_for_the_device(monkeypatch):
    """As the CUDA backend on a GPU takes Triton's: here a built backend without ``table_adamw_``
    on CPU tensors takes the C++ one, and the reference stays the reference."""
    device_of("cpp")

    class NoUpdate:
        pass

    monkeypatch.setitem(ops._backends, "cuda", ops.Backend("cuda", NoUpdate, ("cpu",)))
    cpu = torch.device("cpu")
    assert ops.fused_update("cuda", cpu) is ops.get_backend("cpp").module.table_adamw_
    assert ops.fused_update("torch", cpu) is reference.table_adamw_


def test_fused_table_update_refuses_what_it_cannot_update():
    p = torch.zeros(4, 3)
    args = (torch.arange(4), 0, 3, torch.zeros(3, 2, dtype=torch.int64), 1e-3, 0.9, 0.95, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match=r"grad must be fp32 or bf16 of the table's shape \(4, 3\), got "
                                         r"torch.float16 \(4, 3\)"):
        ops.table_adamw_(p, torch.zeros(4, 3, dtype=torch.float16), torch.zeros(4, 3), torch.zeros(4, 3), *args)
    with pytest.raises(ValueError, match="the moments must share a dtype"):
        ops.table_adamw_(p, torch.zeros(4, 3), torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.bfloat16), *args)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_the_operators_pass_torch_library_opcheck(backend):
    """Schema, fake (meta) shapes, autograd registration and AOT dispatch of the fe_megatron::
    operators agree with their implementations (torch.library.opcheck)."""
    if backend not in ops.available_backends():
        pytest.skip(f"the {backend} backend is not built")
    weight = torch.randn(50, 8, requires_grad=True)
    flat = torch.randint(0, 50, (37,))
    token_ids = torch.randint(0, 100, (2, 9))
    multipliers = torch.randint(1, 1 << 20, (4, 3))
    multipliers[0, 1:] = 0
    moduli, offsets = torch.tensor([101, 103, 107, 109]), torch.tensor([0, 101, 204, 311])
    with ops.use_backend(backend):
        torch.library.opcheck(torch.ops.fe_megatron.gather_rows.default, (weight, flat))
        torch.library.opcheck(torch.ops.fe_megatron.ngram_hash.default, (token_ids, multipliers, moduli, offsets, 0))
        torch.library.opcheck(torch.ops.fe_megatron.gather_rows_grad_into.default,
                              (torch.randn(37, 8), flat, torch.randn(50, 8), backend, True))
    if backend != "torch":  # the torch backend runs the unfused composition, not these operators
        gated = (torch.randn(11, 12, requires_grad=True), torch.randn(11, 8, requires_grad=True),
                 torch.randn(12, 8, requires_grad=True), 16, backend)
        torch.library.opcheck(torch.ops.fe_megatron.gated_reconstruction.default, gated)
        torch.library.opcheck(torch.ops.fe_megatron.gated_reconstruction_backward.default,
                              (torch.randn(11, 8), *(t.detach() for t in gated[:3]), 16, backend))


@pytest.mark.parametrize("weight_decay, width", [(0.0, 64), (0.1, 64), (0.0, 2048)])
def test_rowwise_adagrad_rows_in_cpp_follows_the_reference_and_refuses_bad_ids(weight_decay, width):
    """The sparse rule's fused row update (one pass per touched row) against the reference composition,
    on fresh rows, accumulators and gradients; ids out of range or out of order are refused by value and
    position before any row is written."""
    device_of("cpp")
    gen = torch.Generator().manual_seed(3)
    param, momentum = torch.randn(500, width, generator=gen), torch.rand(500, generator=gen)
    ids = torch.unique(torch.randint(0, 500, (200,), generator=gen))
    grad = torch.randn(ids.numel(), width, generator=gen)
    results = {}
    for backend in ("torch", "cpp"):
        p, m = param.clone(), momentum.clone()
        ops.rowwise_adagrad_rows_(p, m, ids, grad, 2 * width, 0.05, 1e-8, weight_decay, backend=backend)
        results[backend] = (p, m)
    untouched = torch.ones(500, dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(results["cpp"][0][untouched], param[untouched])
    for got, want in zip(results["cpp"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert not torch.equal(results["cpp"][0], param)
    for bad, message in ((torch.tensor([3, 500]), "row id 500 at position 1 is outside \\[0, 500\\)"),
                         (torch.tensor([7, 5]), "sorted, unique row ids; id 5 at position 1 follows 7")):
        p = param.clone()
        with pytest.raises(RuntimeError, match=message):
            ops.rowwise_adagrad_rows_(p, momentum.clone(), bad, torch.randn(2, width, generator=gen), width, 0.05,
                                      1e-8, weight_decay, backend="cpp")
        assert torch.equal(p, param)
