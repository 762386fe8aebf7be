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
"""

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
