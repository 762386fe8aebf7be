"""Reference implementations of every kernel, in plain torch.

These define the semantics that the compiled backends (`cpp`, `cuda`, `triton`) must
match: bit for bit for the hash and the forward gather, within 1e-6 relative for the
table gradient in fp32 (only the summation order of duplicate rows may differ).  They
are vectorized over the whole batch: the only Python loop runs over the n-gram window
(at most the largest order), never over tokens.

Every backend module provides the same three functions:

* ``ngram_hash(token_ids, multipliers, moduli, offsets, pad_id)``
* ``gather_rows_forward(weight, flat_indices) -> [M, w]``
* ``gather_rows_backward(grad_rows, flat_indices, out, deterministic)``, which adds the
  gradient of every looked-up row into ``out`` ([rows, w]) in place, accumulating in at
  least fp32 (how duplicates are ordered and grouped is each backend's; docs/kernels.md).

and may provide a fourth, the table optimizer's fused update (where a backend lacks it, the
fastest backend for the device that has one stands in, else the torch one: `fe_megatron.ops.fused_update`):

* ``table_adamw_(param, grad, exp_avg, exp_avg_sq, global_rows, column_offset, global_width,
  keys, lr, beta1, beta2, eps, weight_decay, step)``: one AdamW step of a table in place, what is
  stored in bf16 written back with stochastic rounding.  A compiled backend may differ from the
  reference in the last fp32 bit of an intermediate, which moves a bf16 result by one bf16 step
  where it moved the rounding's threshold: about one element in a million (tests/unit/ops/test_kernels.py).

and a fifth, the sparse rule's fused row update (`fe_megatron.ops.rowwise_adagrad_rows_`):

* ``rowwise_adagrad_rows_(param, momentum, ids, grad, global_width, lr, eps, weight_decay)``: row-wise
  AdaGrad of an fp32 table's touched rows ``ids`` (sorted, unique) in place. A compiled backend sums a row's
  squares in its own order: within 1e-6 relative of the reference.

and the basis-gated reconstruction of FactorEngram's branch (Eq. 7-9; `fe_megatron.ops.gated_reconstruction`),
as a forward and a backward that recomputes the gate instead of saving it:

* ``gated_reconstruction_forward(coefficients, query, dictionary, hidden_size) -> [M, d_m]``;
* ``gated_reconstruction_backward(grad_memory, coefficients, query, dictionary, hidden_size)
  -> (grad_coefficients, grad_query, grad_dictionary)``.

A compiled backend computes the two products through a GEMM library and the gate around them, so its sums run in
the library's order: within 1e-5 of the largest value in fp32 (tests/unit/ops/test_fused_branch.py).
"""

import math

import torch
import torch.nn.functional as F


def ngram_hash(token_ids: torch.Tensor, multipliers: torch.Tensor, moduli: torch.Tensor,
               offsets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Row indices of every branch (Eq. 1, 6).

    For branch ``b`` with multipliers ``m_{b,k}`` (zero beyond its order):
    ``index[t, b] = (XOR_k x_{t-k} * m_{b,k}) mod p_b + offset_b`` with ``x_{t-k} = pad_id``
    before the sequence start.  A unigram branch has ``m = (1, 0, ...)`` and ``p_b`` >= the
    vocabulary, which is direct indexing.  All products stay below 2^63 by construction
    (see `fe_megatron.ngram.hashing.layer_multipliers`), so int64 arithmetic is exact.

    token_ids: [B, T] int64; multipliers: [nb, K]; moduli, offsets: [nb]. Returns [B, T, nb] int64.
    """
    batch, seq = token_ids.shape
    window = multipliers.shape[1]
    x = token_ids.to(torch.int64)
    mix = torch.zeros(batch, seq, multipliers.shape[0], dtype=torch.int64, device=x.device)
    for k in range(window):
        shifted = F.pad(x, (k, 0), value=pad_id)[:, :seq] if k else x  # x_{t-k}
        mix.bitwise_xor_(shifted.unsqueeze(-1) * multipliers[:, k])
    return torch.remainder(mix, moduli) + offsets


def gather_rows_forward(weight: torch.Tensor, flat_indices: torch.Tensor) -> torch.Tensor:
    """``weight[flat_indices]``: [rows, w], [M] int64 -> [M, w]."""
    return weight.index_select(0, flat_indices)


def gather_rows_backward(grad_rows: torch.Tensor, flat_indices: torch.Tensor, out: torch.Tensor,
                         deterministic: bool = True) -> None:
    """``out[i] += sum_{m: flat_indices[m] = i} grad_rows[m]`` for every looked-up row ``i``.

    fp32 and fp64 ``out``: one ``index_add_`` (sequential, so deterministic, on CPU; atomic
    on CUDA).  bf16 and fp16: duplicates are summed in fp32 first, then each unique row of
    ``out`` is updated once, so the gradient is rounded once per row, not once per duplicate.
    """
    del deterministic  # the reference has one order per device
    if out.dtype in (torch.float32, torch.float64):
        out.index_add_(0, flat_indices, grad_rows.to(out.dtype))
        return
    unique, inverse = torch.unique(flat_indices, return_inverse=True)
    sums = torch.zeros(unique.numel(), grad_rows.shape[1], dtype=torch.float32, device=grad_rows.device)
    sums.index_add_(0, inverse, grad_rows.to(torch.float32))
    out.index_copy_(0, unique, (out.index_select(0, unique).to(torch.float32) + sums).to(out.dtype))


# ----------------------------------------------------------------------------- the table optimizer's update
_LOW31 = 0x7FFFFFFF
ELEMENTS_PER_BLOCK = 1 << 20  # table elements updated at a time: bounds the scratch


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer hash with full avalanche on 31-bit values (Mueller's 0x45d9f3b mixer); every
    intermediate stays below 2^58, so int64 arithmetic never overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _LOW31
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _LOW31
    return x ^ (x >> 16)


def counter_noise(key1: int, key2: int, element_ids: torch.Tensor) -> torch.Tensor:
    """Uniform 16-bit integers (int32), one per entry of ``element_ids`` (int64 >= 0), a function of
    the 31-bit keys and the id alone (a counter-based generator)."""
    ids = element_ids.to(torch.int64)
    mixed = _mix31(_mix31((ids & _LOW31) ^ key1) ^ (ids >> 31) ^ key2)
    return ((mixed >> 8) & 0xFFFF).to(torch.int32)


def stochastic_round_to_bf16(values: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``values`` (fp32) in bfloat16, rounded up or down at random so that ``E[round(x)] = x``:
    ``noise`` (uniform integers in ``[0, 2^16)``, one per value) is added to the bits that bf16
    drops and the sum truncated, which rounds the magnitude up with probability (dropped bits) /
    2^16.  Values that are inf or nan are kept as they are."""
    values = values.float().contiguous()
    bits = values.view(torch.int32)
    rounded = ((bits + noise.to(torch.int32)) & -65536).view(torch.float32)  # -65536: 0xFFFF0000
    return torch.where(torch.isfinite(values), rounded, values).to(torch.bfloat16)


def _adamw(param, grad, exp_avg, exp_avg_sq, step: int, lr: float, beta1: float, beta2: float, eps: float,
           weight_decay: float) -> None:
    """One AdamW update of fp32 ``param`` in place, in the order of torch's single-tensor AdamW."""
    grad = grad.float()
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def table_adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 global_rows: torch.Tensor, column_offset: int, global_width: int, keys: torch.Tensor, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One AdamW step (torch's, decoupled weight decay) of table ``param`` [rows, w] in place, a
    block of rows at a time.  ``param`` fp32 or bf16; ``grad`` fp32 or bf16; the moments fp32 or
    bf16.  Each tensor stored in bf16 is written back with `stochastic_round_to_bf16`, its noise
    `counter_noise` of ``keys[t]`` (``keys``: [3, 2] int64, for param, exp_avg, exp_avg_sq) and the
    element's global id ``global_rows[r] * global_width + column_offset + c``."""
    width = param.shape[1]
    columns = torch.arange(column_offset, column_offset + width, dtype=torch.int64, device=param.device)
    key_pairs = [(int(keys[t, 0]), int(keys[t, 1])) for t in range(3)]
    rows_per_block = max(1, ELEMENTS_PER_BLOCK // width)
    for first in range(0, param.shape[0], rows_per_block):
        block = slice(first, first + rows_per_block)
        tensors = (param[block], exp_avg[block], exp_avg_sq[block])
        values = [tensor if tensor.dtype == torch.float32 else tensor.float() for tensor in tensors]
        _adamw(values[0], grad[block], values[1], values[2], step, lr, beta1, beta2, eps, weight_decay)
        element_ids = None
        for tensor, updated, (key1, key2) in zip(tensors, values, key_pairs):
            if tensor.dtype == torch.bfloat16:  # fp32 ones were updated in place
                if element_ids is None:
                    element_ids = global_rows[block, None] * global_width + columns
                tensor.copy_(stochastic_round_to_bf16(updated, counter_noise(key1, key2, element_ids)))


def rowwise_adagrad_rows_(param: torch.Tensor, momentum: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor,
                          global_width: int, lr: float, eps: float, weight_decay: float) -> None:
    """FBGEMM's exact row-wise AdaGrad of fp32 table ``param``'s rows ``ids`` ([U] sorted, unique) with their
    gradients ``grad`` ([U, w] fp32), in place: ``G_r += mean_c(g_rc^2)`` (over the row's ``global_width``
    columns; ``momentum`` [rows]), ``w_r = w_r (1 - lr wd) - lr g_r / (sqrt(G_r) + eps)``."""
    accumulated = momentum.index_select(0, ids) + grad.square().sum(dim=1) / global_width
    momentum.index_copy_(0, ids, accumulated)
    rows = param.index_select(0, ids)
    if weight_decay:
        rows.mul_(1.0 - lr * weight_decay)
    rows.addcdiv_(grad, (accumulated.sqrt() + eps).unsqueeze(1), value=-lr)
    param.index_copy_(0, ids, rows)


# ----------------------------------------------------------------------------- the basis-gated reconstruction
def basis_gate(query: torch.Tensor, dictionary: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Eq. 7 (second half): ``alpha_t = sigmoid(D q_t / sqrt(d))``, one gate per dictionary row.

    query: [..., d_m]; dictionary: [s, d_m] (or a slice of its rows). Returns [..., s].
    """
    return torch.sigmoid(torch.matmul(query, dictionary.t()) / math.sqrt(hidden_size))


def gated_reconstruction(coefficients: torch.Tensor, query: torch.Tensor, dictionary: torch.Tensor,
                         hidden_size: int) -> torch.Tensor:
    """Eq. 7-9: ``e_t = D^T (z_t * alpha_t)``, ``alpha_t = sigmoid(D q_t / sqrt(d))``, as separate torch operations
    (the unfused branch: autograd saves the gate and the gated coefficients, ``[..., s]`` each).

    coefficients: [..., s]; query: [..., d_m]; dictionary: [s, d_m] (a tensor-parallel rank's rows: the result is
    then that rank's share of the sum over rows). Returns [..., d_m]."""
    return torch.matmul(coefficients * basis_gate(query, dictionary, hidden_size), dictionary)


def gated_reconstruction_forward(coefficients: torch.Tensor, query: torch.Tensor, dictionary: torch.Tensor,
                                 hidden_size: int) -> torch.Tensor:
    """`gated_reconstruction` of [M, s] coefficients and [M, d_m] queries, without autograd."""
    return gated_reconstruction(coefficients, query, dictionary, hidden_size)


def gated_reconstruction_backward(grad_memory: torch.Tensor, coefficients: torch.Tensor, query: torch.Tensor,
                                  dictionary: torch.Tensor, hidden_size: int) -> tuple:
    """The gradients of `gated_reconstruction` from its inputs alone, the gate recomputed. With ``g = D q / sqrt(d)``,
    ``alpha = sigmoid(g)``, ``u = z * alpha`` and ``G = dL/de D^T`` (dL/du):

        dL/dz = G * alpha,   dL/dg = G * z * alpha (1 - alpha) / sqrt(d),
        dL/dq = dL/dg D,     dL/dD = dL/dg^T q + u^T dL/de.

    Returns ``(grad_coefficients [M, s], grad_query [M, d_m], grad_dictionary [s, d_m])``."""
    divisor = math.sqrt(hidden_size)
    alpha = torch.sigmoid(torch.matmul(query, dictionary.t()) / divisor)
    grad_gated = torch.matmul(grad_memory, dictionary.t())
    grad_logits = grad_gated * coefficients * alpha * (1 - alpha) / divisor
    grad_dictionary = torch.matmul(grad_logits.t(), query) + torch.matmul((coefficients * alpha).t(), grad_memory)
    return grad_gated * alpha, torch.matmul(grad_logits, dictionary), grad_dictionary


def basis_memory_values(hidden: torch.Tensor, coefficients: torch.Tensor, query_weight: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float, dictionary: torch.Tensor, value_weight: torch.Tensor,
                        hidden_size: int) -> torch.Tensor:
    """``v = V D^T (z * sigmoid(D RMSNorm(Q^T h) / sqrt(d)))`` (Eq. 7-9): the branch's position-wise memory, as its
    modules compute it (``query_proj``, ``query_norm``, `gated_reconstruction`, ``value_proj``)."""
    query = F.rms_norm(F.linear(hidden, query_weight), (query_weight.shape[0],), norm_weight, eps)
    return F.linear(gated_reconstruction(coefficients, query, dictionary, hidden_size), value_weight)


def short_conv_decode_(values: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, norm_weight: torch.Tensor,
                       conv_weight: torch.Tensor, dilation: int, eps: float) -> torch.Tensor:
    """Eq. 10 at one new position of each sequence: ``m = v + SiLU(sum_k w_k * RMSNorm(v_{t - (K-1-k) r}))``, the
    earlier values ``state[slots, :(K-1) r]``, which then holds the last ``(K-1) r`` values (values [R, C], state
    [slots, >= (K-1) r, C], conv_weight [C, K]). Returns [R, C]."""
    history = (conv_weight.shape[1] - 1) * dilation
    window = torch.cat([state[slots, :history].to(values.dtype), values.unsqueeze(1)], 1)  # [R, h + 1, C]
    taps = F.rms_norm(window[:, ::dilation], (values.shape[1],), norm_weight, eps)  # t-(K-1)r, .., t
    refined = values + F.silu((taps * conv_weight.t()).sum(1))
    if history:
        state[slots, :history] = window[:, 1:].to(state.dtype)
    return refined


def ngram_hash_decode_(ids: torch.Tensor, id_state: torch.Tensor, slots: torch.Tensor, multipliers: torch.Tensor,
                       moduli: torch.Tensor, offsets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Eq. 1 at one new position of each sequence (`ngram_hash` of its window's last position): the ids ``ids`` [R]
    after the last ``K - 1`` ids in ``id_state[slots, :K - 1]`` (``[slots, >= K - 1]``), which then holds the last
    ``K - 1`` ids. Returns [R, branches]."""
    history = multipliers.shape[1] - 1
    window = torch.cat([id_state[slots, :history].to(torch.int64), ids.unsqueeze(1)], 1)  # [R, K]
    indices = ngram_hash(window, multipliers, moduli, offsets, pad_id)[:, -1]
    if history:
        id_state[slots, :history] = window[:, 1:].to(id_state.dtype)
    return indices
