"""Reference implementations of every kernel, in plain torch.

These define the semantics that faster backends must match bit for bit (hash) or to
the stated tolerance (gradients).  They are vectorized over the whole batch: the only
Python loop runs over the n-gram window (at most the largest order), never over tokens.
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


def gather_rows(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``weight[indices]`` with the embedding backward (a deterministic index_add on CPU).

    weight: [rows, s_b]; indices: [..., nb]. Returns [..., nb, s_b].
    """
    return F.embedding(indices, weight)
