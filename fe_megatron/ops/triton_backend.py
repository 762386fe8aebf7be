"""Triton kernels for `fe_megatron.ops`: hash, gather, the deduplicated table backward and the
table optimizer's fused update.

The contract of every backend and the algorithms of the CUDA kernels (docs/kernels.md);
on CPU they run under ``TRITON_INTERPRET=1`` (the CI path), on a GPU compiled.  The sort of the
backward is ``torch.sort`` (a radix sort on GPU): a well-kept primitive, not ours.
"""

import torch
import triton
import triton.language as tl

# Sorted positions reduced by one program: equal to the CUDA chunk (and the C++ one for
# bf16/fp16 outputs), so that they sum duplicates in the same order.
CHUNK = 32


@triton.jit
def _columns_if(column_mask, condition):
    """``column_mask & condition`` for a scalar condition, kept boolean (the interpreter
    widens a plain ``&`` of a vector and a scalar to int32, which it refuses as a mask)."""
    return tl.where(condition, column_mask, False)


@triton.jit
def _ngram_hash_kernel(ids_ptr, mult_ptr, mod_ptr, off_ptr, out_ptr, total, seq, branches, pad_id,
                       WINDOW: tl.constexpr, BLOCK: tl.constexpr):
    element = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = element < total
    token = element // branches
    branch = element % branches
    t = token % seq
    mix = tl.zeros([BLOCK], dtype=tl.int64)
    for k in tl.static_range(WINDOW):
        x = tl.load(ids_ptr + token - k, mask=mask & (t >= k), other=pad_id)
        m = tl.load(mult_ptr + branch * WINDOW + k, mask=mask, other=0)
        mix = mix ^ (x * m)
    modulus = tl.load(mod_ptr + branch, mask=mask, other=1)
    r = mix % modulus
    r = tl.where(r < 0, r + modulus, r)  # torch.remainder takes the divisor's sign
    tl.store(out_ptr + element, r + tl.load(off_ptr + branch, mask=mask, other=0), mask=mask)


@triton.jit
def _gather_kernel(weight_ptr, idx_ptr, out_ptr, count, width, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    row_mask = rows < count
    mask = row_mask[:, None] & (cols < width)[None, :]
    src = tl.load(idx_ptr + rows, mask=row_mask, other=0)
    values = tl.load(weight_ptr + src[:, None] * width + cols[None, :], mask=mask)
    tl.store(out_ptr + rows[:, None] * width + cols[None, :], values, mask=mask)


@triton.jit
def _reduce_chunks_kernel(grad_ptr, sorted_ptr, perm_ptr, out_ptr, first_ptr, last_ptr, count, width,
                          CHUNK_SIZE: tl.constexpr, BLOCK_W: tl.constexpr):
    """Pass 1: each program sums the runs of equal rows in its chunk of sorted positions.
    Whole runs go to ``out``; a leading continuation goes to ``first[c]``, a trailing run
    that goes on past the chunk to ``last[c]``."""
    chunk = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cmask = cols < width
    lo = chunk * CHUNK_SIZE
    hi = tl.minimum(lo + CHUNK_SIZE, count)
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    start = lo
    for i in range(lo, hi):
        row = tl.load(sorted_ptr + i)
        acc += tl.load(grad_ptr + tl.load(perm_ptr + i) * width + cols, mask=cmask, other=0.0).to(tl.float32)
        nxt = tl.load(sorted_ptr + i + 1, mask=i + 1 < count, other=-1)
        prev = tl.load(sorted_ptr + start - 1, mask=start > 0, other=-1)
        run_end = (i + 1 == hi) | (nxt != row)
        starts_here = prev != row
        ends_here = nxt != row
        direct = run_end & starts_here & ends_here
        dst = out_ptr + row * width + cols
        old = tl.load(dst, mask=_columns_if(cmask, direct), other=0.0).to(tl.float32)
        tl.store(dst, (old + acc).to(out_ptr.dtype.element_ty), mask=_columns_if(cmask, direct))
        tl.store(last_ptr + chunk * width + cols, acc, mask=_columns_if(cmask, run_end & starts_here & (nxt == row)))
        tl.store(first_ptr + chunk * width + cols, acc, mask=_columns_if(cmask, run_end & (prev == row)))
        acc = tl.where(run_end, 0.0, acc)
        start = tl.where(run_end, i + 1, start)


@triton.jit
def _finish_runs_kernel(sorted_ptr, out_ptr, first_ptr, last_ptr, count, width, chunks,
                        CHUNK_SIZE: tl.constexpr, BLOCK_W: tl.constexpr):
    """Pass 2: the chunk holding the head of a run that crosses chunk boundaries adds its
    ``last`` part and the following chunks' ``first`` parts, in chunk order, to ``out``."""
    chunk = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cmask = cols < width
    lo = chunk * CHUNK_SIZE
    e = tl.minimum(lo + CHUNK_SIZE, count) - 1
    row = tl.load(sorted_ptr + e)
    nxt = tl.load(sorted_ptr + e + 1, mask=e + 1 < count, other=-1)
    prev = tl.load(sorted_ptr + lo - 1, mask=lo > 0, other=-1)
    own = (nxt == row) & (prev != row)
    total = tl.load(last_ptr + chunk * width + cols, mask=_columns_if(cmask, own), other=0.0)
    k = chunk + 1
    go = own
    while go:
        total += tl.load(first_ptr + k * width + cols, mask=cmask, other=0.0)
        ek = tl.minimum((k + 1) * CHUNK_SIZE, count) - 1
        tail = tl.load(sorted_ptr + ek)
        after = tl.load(sorted_ptr + ek + 1, mask=ek + 1 < count, other=-1)
        go = (tail == row) & (after == row)
        k += 1
    dst = out_ptr + row * width + cols
    old = tl.load(dst, mask=_columns_if(cmask, own), other=0.0).to(tl.float32)
    tl.store(dst, (old + total).to(out_ptr.dtype.element_ty), mask=_columns_if(cmask, own))


@triton.jit
def _atomic_scatter_kernel(grad_ptr, idx_ptr, out_ptr, count, width, BLOCK_M: tl.constexpr,
                           BLOCK_W: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    row_mask = rows < count
    mask = row_mask[:, None] & (cols < width)[None, :]
    dst = tl.load(idx_ptr + rows, mask=row_mask, other=0)
    values = tl.load(grad_ptr + rows[:, None] * width + cols[None, :], mask=mask, other=0.0)
    tl.atomic_add(out_ptr + dst[:, None] * width + cols[None, :], values.to(out_ptr.dtype.element_ty), mask=mask)


def _column_block(width: int) -> int:
    return min(triton.next_power_of_2(width), 256)


def ngram_hash(token_ids, multipliers, moduli, offsets, pad_id):
    batch, seq = token_ids.shape
    branches, window = multipliers.shape
    out = torch.empty(batch, seq, branches, dtype=torch.int64, device=token_ids.device)
    total = out.numel()
    if total:
        block = 1024
        _ngram_hash_kernel[(triton.cdiv(total, block),)](token_ids, multipliers, moduli, offsets, out, total, seq,
                                                        branches, pad_id, WINDOW=window, BLOCK=block)
    return out


def gather_rows_forward(weight, flat_indices):
    count, width = flat_indices.numel(), weight.shape[1]
    out = torch.empty(count, width, dtype=weight.dtype, device=weight.device)
    if count:
        block_w = _column_block(width)
        block_m = max(1, 4096 // block_w)
        _gather_kernel[(triton.cdiv(count, block_m), triton.cdiv(width, block_w))](
            weight, flat_indices, out, count, width, BLOCK_M=block_m, BLOCK_W=block_w)
    return out


def gather_rows_backward(grad_rows, flat_indices, out, deterministic=True):
    count, width = grad_rows.shape
    if count == 0:
        return
    block_w = _column_block(width)
    if not deterministic and out.dtype == torch.float32:  # bf16 would round once per duplicate
        block_m = max(1, 4096 // block_w)
        _atomic_scatter_kernel[(triton.cdiv(count, block_m), triton.cdiv(width, block_w))](
            grad_rows, flat_indices, out, count, width, BLOCK_M=block_m, BLOCK_W=block_w)
        return
    sorted_rows, perm = torch.sort(flat_indices, stable=True)
    chunks = triton.cdiv(count, CHUNK)
    first = torch.empty(chunks, width, dtype=torch.float32, device=out.device)
    last = torch.empty_like(first)
    grid = (chunks, triton.cdiv(width, block_w))
    _reduce_chunks_kernel[grid](grad_rows, sorted_rows, perm, out, first, last, count, width,
                                CHUNK_SIZE=CHUNK, BLOCK_W=block_w)
    _finish_runs_kernel[grid](sorted_rows, out, first, last, count, width, chunks,
                              CHUNK_SIZE=CHUNK, BLOCK_W=block_w)


# ----------------------------------------------------------------------------- the table optimizer's update
# constants read inside @triton.jit functions must be tl.constexpr: the compiler refuses other
# globals (Triton's CPU interpreter accepts them, so tests/unit/ops/test_kernels.py checks this by name)
_LOW31 = tl.constexpr(0x7FFFFFFF)
_MIXER = tl.constexpr(0x45D9F3B)
UPDATE_BLOCK = 1024  # table elements per program


@triton.jit
def _mix31(x):
    """`fe_megatron.ops.reference._mix31` in int64 (every intermediate below 2^58)."""
    x = x ^ (x >> 16)
    x = (x * _MIXER) & _LOW31
    x = x ^ (x >> 16)
    x = (x * _MIXER) & _LOW31
    return x ^ (x >> 16)


@triton.jit
def _store_rounded(ptr, offsets, value, element_id, key1, key2, mask, TO_BF16: tl.constexpr):
    """Store fp32 ``value``, or in bf16 with `reference.stochastic_round_to_bf16` of
    `reference.counter_noise` (``key1``, ``key2``, ``element_id``)."""
    if TO_BF16:
        noise = (_mix31(_mix31((element_id & _LOW31) ^ key1) ^ (element_id >> 31) ^ key2) >> 8) & 0xFFFF
        bits = value.to(tl.int32, bitcast=True)
        rounded = ((bits + noise.to(tl.int32)) & -65536).to(tl.float32, bitcast=True)  # int32 add: wraps as torch's
        finite = (bits & 0x7F800000) != 0x7F800000
        tl.store(ptr + offsets, tl.where(finite, rounded, value).to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptr + offsets, value, mask=mask)


@triton.jit
def _table_adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, global_rows_ptr, total, width,
                        column_offset, global_width, param_key1, param_key2, avg_key1, avg_key2, sq_key1, sq_key2,
                        decay, weight1, beta2, weight2, bias_correction2_sqrt, eps, step_size,
                        PARAM_BF16: tl.constexpr, STATE_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """One AdamW step of ``BLOCK`` table elements, in the C++ kernel's order of operations (torch's
    single-tensor AdamW): IEEE division and square root, and no fused multiply-add but lerp's."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < total
    row = offsets // width
    column = column_offset + (offsets - row * width)
    element_id = tl.load(global_rows_ptr + row, mask=mask, other=0) * global_width + column
    g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * decay  # param.mul_(1 - lr wd)
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.fma(weight1, g - m, m)  # exp_avg.lerp_(grad, 1 - beta1)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * beta2 + weight2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps  # (exp_avg_sq.sqrt() / bc2).add_(eps)
    p = p + step_size * tl.div_rn(m, denom)  # addcdiv_(exp_avg, denom, -lr / bc1)
    _store_rounded(param_ptr, offsets, p, element_id, param_key1, param_key2, mask, PARAM_BF16)
    _store_rounded(exp_avg_ptr, offsets, m, element_id, avg_key1, avg_key2, mask, STATE_BF16)
    _store_rounded(exp_avg_sq_ptr, offsets, v, element_id, sq_key1, sq_key2, mask, STATE_BF16)


def table_adamw_(param, grad, exp_avg, exp_avg_sq, global_rows, column_offset, global_width, keys, lr, beta1, beta2,
                 eps, weight_decay, step):
    """`fe_megatron.ops.reference.table_adamw_` in one pass (the scalars rounded to fp32 as the C++
    kernel rounds them)."""
    total = param.numel()
    if total == 0:
        return
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2_sqrt = (1.0 - beta2 ** step) ** 0.5
    key = [int(k) for k in keys.reshape(-1).tolist()]
    extra = {} if param.device.type == "cpu" else {"enable_fp_fusion": False}  # the interpreter takes no options
    _table_adamw_kernel[(triton.cdiv(total, UPDATE_BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, global_rows, total, param.shape[1], column_offset, global_width, *key,
        1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, bias_correction2_sqrt, eps, -lr / bias_correction1,
        PARAM_BF16=param.dtype == torch.bfloat16, STATE_BF16=exp_avg.dtype == torch.bfloat16, BLOCK=UPDATE_BLOCK,
        **extra)


# ----------------------------------------------------------------------------- the basis-gated reconstruction
# Eq. 7-9, e = D^T (z * sigmoid(D q / sqrt(d))): the gate is the epilogue of the D q GEMM, a tile of logits at a
# time in registers, so the [M, s] gate never reaches memory; the reconstruction and the backward's products are
# cuBLAS GEMMs (torch.mm). The backward's kernel recomputes the logits beside dL/du = dL/de D^T, two GEMMs into
# one tile, and writes dL/dz, dL/dg and u from it.
@triton.jit
def _logits_tile(a_ptr, d_ptr, rows, cols, M, S, DM, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a[rows] @ D[cols]^T`` in fp32: [BLOCK_M, BLOCK_S]."""
    acc = tl.zeros([BLOCK_M, BLOCK_S], dtype=tl.float32)
    for k0 in range(0, DM, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * DM + ks[None, :], mask=(rows < M)[:, None] & (ks < DM)[None, :],
                    other=0.0)
        b = tl.load(d_ptr + cols[None, :] * DM + ks[:, None], mask=(ks < DM)[:, None] & (cols < S)[None, :],
                    other=0.0)
        if UPCAST:  # Triton's interpreter computes bf16 dots wrongly (numpy has no bf16): there they take fp32
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gate_coefficients_kernel(query_ptr, dictionary_ptr, coefficients_ptr, out_ptr, M, S, DM, divisor,
                              BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                              PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    logits = _logits_tile(query_ptr, dictionary_ptr, rows, cols, M, S, DM, BLOCK_M, BLOCK_S, BLOCK_K, PRECISION,
                          UPCAST)
    mask = (rows < M)[:, None] & (cols < S)[None, :]
    where = rows[:, None] * S + cols[None, :]
    z = tl.load(coefficients_ptr + where, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + where, (z * tl.sigmoid(logits / divisor)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_backward_kernel(query_ptr, grad_memory_ptr, dictionary_ptr, coefficients_ptr, grad_coefficients_ptr,
                          grad_logits_ptr, gated_ptr, M, S, DM, divisor, BLOCK_M: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    logits = _logits_tile(query_ptr, dictionary_ptr, rows, cols, M, S, DM, BLOCK_M, BLOCK_S, BLOCK_K, PRECISION,
                          UPCAST)
    grad_gated = _logits_tile(grad_memory_ptr, dictionary_ptr, rows, cols, M, S, DM, BLOCK_M, BLOCK_S, BLOCK_K,
                              PRECISION, UPCAST)  # dL/du
    mask = (rows < M)[:, None] & (cols < S)[None, :]
    where = rows[:, None] * S + cols[None, :]
    z = tl.load(coefficients_ptr + where, mask=mask, other=0.0).to(tl.float32)
    alpha = tl.sigmoid(logits / divisor)
    kind = grad_coefficients_ptr.dtype.element_ty
    tl.store(grad_coefficients_ptr + where, (grad_gated * alpha).to(kind), mask=mask)
    tl.store(grad_logits_ptr + where, (grad_gated * z * alpha * (1.0 - alpha) / divisor).to(kind), mask=mask)
    tl.store(gated_ptr + where, (z * alpha).to(kind), mask=mask)


def _gate_launch(rows: int, width: int, memory_dim: int, dtype: torch.dtype) -> tuple:
    """``(grid, block sizes, precision)`` of the gate's kernels: tiles of 64 x 64 on a GPU (32 x 32 in the
    interpreter, whose dot wants at least 16), fp32 dots in IEEE precision unless torch allows TF32 for matmuls."""
    interpreted = not torch.cuda.is_available()
    block_m = block_s = 32 if interpreted else 64
    block_k = 32 if memory_dim >= 32 or interpreted else 16
    tf32 = dtype == torch.float32 and not interpreted and torch.backends.cuda.matmul.allow_tf32
    precision = "tf32" if tf32 else "ieee"
    grid = (triton.cdiv(rows, block_m), triton.cdiv(width, block_s))
    return grid, dict(BLOCK_M=block_m, BLOCK_S=block_s, BLOCK_K=block_k, PRECISION=precision, UPCAST=interpreted)


def gated_reconstruction_forward(coefficients, query, dictionary, hidden_size):
    rows, width = coefficients.shape
    gated = torch.empty_like(coefficients)  # z * alpha, [M, s]: the reconstruction GEMM's input
    if rows:
        grid, blocks = _gate_launch(rows, width, dictionary.shape[1], coefficients.dtype)
        _gate_coefficients_kernel[grid](query, dictionary, coefficients, gated, rows, width, dictionary.shape[1],
                                        float(hidden_size) ** 0.5, **blocks)
    return torch.mm(gated, dictionary)


def gated_reconstruction_backward(grad_memory, coefficients, query, dictionary, hidden_size):
    rows, width = coefficients.shape
    grad_coefficients = torch.empty_like(coefficients)
    grad_logits, gated = torch.empty_like(coefficients), torch.empty_like(coefficients)
    if rows:
        grid, blocks = _gate_launch(rows, width, dictionary.shape[1], coefficients.dtype)
        _gate_backward_kernel[grid](query, grad_memory, dictionary, coefficients, grad_coefficients, grad_logits, gated,
                                    rows, width, dictionary.shape[1], float(hidden_size) ** 0.5, **blocks)
    grad_dictionary = torch.addmm(torch.mm(grad_logits.t(), query), gated.t(), grad_memory)
    return grad_coefficients, torch.mm(grad_logits, dictionary), grad_dictionary
