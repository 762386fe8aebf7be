"""Multi-head n-gram addressing (Eq. 1 and the address functions phi_b of Eq. 6).

Scheme (after DeepSeek's public Engram code, made platform-independent):

* Unigram heads index their table directly by (optionally compressed) token id.
* Every insertion layer draws odd int64 multipliers ``m_0 .. m_{K-1}`` (K = largest
  order) from a splitmix64 stream seeded by ``hash_seed + 10007 * layer``.  An order-n
  suffix mixes as ``x_t*m_0 XOR x_{t-1}*m_1 XOR ... XOR x_{t-n+1}*m_{n-1}``.
* Head j of order n reduces the mix modulo its own prime ``p`` >= the requested
  capacity.  Primes are distinct across all heads, orders and layers, so heads of one
  order collide on different n-gram pairs.
* Positions before the sequence start read ``pad_id`` = the lookup vocabulary size, an
  id no real token has.
* Documents packed into one sequence: with ``position_ids`` (reset to 0 where each document
  starts, as Megatron-LM's ``--reset-position-ids``, fe-pretrain's ``data.reset_position_ids`` and
  packed Hugging Face batches give them), an n-gram reaches back no further than its position id:
  ids before its document's first token read ``pad_id`` too, as before a sequence start, so no
  n-gram spans two documents (`within_documents`).  Positions that count up from 0 (no reset)
  change nothing.

splitmix64 replaces NumPy's generator because NumPy promises no stream stability across
versions; this way indices are identical on every machine and release (golden vectors
in ``tests/unit/ngram/test_hashing.py`` pin them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from fe_megatron import ops
from fe_megatron.config import MemoryConfig

_INT64_MAX = (1 << 63) - 1
_MASK64 = (1 << 64) - 1
_LAYER_SEED_STRIDE = 10007
TOKEN_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _splitmix64(state: int):
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (covers every int64)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def layer_multipliers(hash_seed: int, layer: int, window: int, lookup_vocab: int) -> list:
    """Odd multipliers for one layer, bounded so that ``x * m`` never overflows int64 for
    every id ``x <= lookup_vocab`` (real ids and the pad id)."""
    half_bound = max(1, (_INT64_MAX // (lookup_vocab + 1)) // 2)
    state = (hash_seed + _LAYER_SEED_STRIDE * layer) & _MASK64
    out = []
    for _ in range(window):
        state, r = _splitmix64(state)
        out.append(2 * (r % half_bound) + 1)
    return out


@dataclass(frozen=True)
class BranchLayout:
    """Addressing constants of one layer's branches, in the fixed branch order."""

    layer: int
    orders: tuple
    multipliers: tuple  # per branch, a tuple of `window` ints (zeros beyond its order)
    moduli: tuple  # table rows per branch: capacity for unigrams, a prime for hashed heads
    offsets: tuple  # first row of each branch inside the layer's single table buffer

    @property
    def total_rows(self) -> int:
        return self.offsets[-1] + self.moduli[-1]


@functools.lru_cache(maxsize=64)
def _layouts(config_key: tuple) -> dict:
    (orders, heads, capacity, layers, hash_seed, lookup_vocab) = config_key
    window = max(orders)
    seen_primes = set()
    out = {}
    for layer in layers:
        mult = layer_multipliers(hash_seed, layer, window, lookup_vocab)
        b_orders, b_mult, b_mod = [], [], []
        for n, n_heads, cap in zip(orders, heads, capacity):
            candidate = cap - 1
            for _ in range(n_heads):
                b_orders.append(n)
                if n == 1:
                    b_mult.append((1,) + (0,) * (window - 1))
                    b_mod.append(cap)
                    continue
                candidate += 1
                while not _is_prime(candidate) or candidate in seen_primes:
                    candidate += 1
                seen_primes.add(candidate)
                b_mult.append(tuple(mult[:n]) + (0,) * (window - n))
                b_mod.append(candidate)
        offsets, total = [], 0
        for rows in b_mod:
            offsets.append(total)
            total += rows
        out[layer] = BranchLayout(layer, tuple(b_orders), tuple(b_mult), tuple(b_mod), tuple(offsets))
    return out


def lookup_vocab_size(config: MemoryConfig) -> int:
    """Ids the addressing sees: the compressed vocabulary if compression is on."""
    if config.token_compression is None:
        return config.vocab_size
    from fe_megatron.ngram.compression import load_token_compression

    return load_token_compression(config.token_compression, config.vocab_size).num_compressed


def branch_layouts(config: MemoryConfig) -> dict:
    """``{layer: BranchLayout}`` for every insertion layer of ``config``."""
    vocab = lookup_vocab_size(config)
    config.check_unigram_capacity(vocab)
    key = (tuple(config.ngram_orders), tuple(config.heads_per_order), tuple(config.table_capacity),
           tuple(config.layers), config.hash_seed, vocab)
    return _layouts(key)


def validate_token_ids(token_ids: torch.Tensor, vocab_size: int) -> None:
    """Check dtype, shape and range of a ``[batch, seq]`` id tensor.

    Costs one host synchronisation (``bool(bad.any())``) per call; callers hash once per
    microbatch, so this is once per microbatch, not once per layer.  Inside a graph that
    torch.compile traces, the range check is a device-side assert (no synchronisation, and a
    message without the position).
    """
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_ids must be a torch.Tensor, got {type(token_ids).__name__}")
    if token_ids.dtype not in TOKEN_ID_DTYPES:
        accepted = ", ".join(str(dtype).replace("torch.", "") for dtype in TOKEN_ID_DTYPES)
        raise TypeError(f"token_ids must be an integer tensor ({accepted}), got dtype {token_ids.dtype}")
    if token_ids.dim() != 2:
        raise ValueError(f"token_ids must have shape [batch, seq], got shape {tuple(token_ids.shape)}")
    bad = (token_ids < 0) | (token_ids >= vocab_size)
    if torch.compiler.is_compiling():  # no host sync inside a compiled graph: a device-side assert instead
        torch._assert_async(~bad.any(), f"token ids outside the vocabulary range [0, {vocab_size}) of "
                                        f"MemoryConfig.vocab_size={vocab_size}")
        return
    if bool(bad.any()):
        pos = bad.nonzero()[0].tolist()
        value = int(token_ids[pos[0], pos[1]])
        raise ValueError(f"token id {value} at [batch={pos[0]}, position={pos[1]}] is outside the vocabulary "
                         f"range [0, {vocab_size}) of MemoryConfig.vocab_size={vocab_size}")


class NgramHasher:
    """Row indices into a layer's ``tables.weight`` (branch offsets included).

    ``NgramHasher(config, layer_index)`` addresses one insertion layer (one of
    ``config.layers``, 0-based); ``NgramHasher(config)`` addresses all insertion layers and
    ``NgramHasher(config, [i, j])`` a subset (a pipeline stage's), in a single kernel launch
    (``indices_per_layer``), which is what a model does once per microbatch.
    """

    def __init__(self, config: MemoryConfig, layers: Union[int, Sequence[int], None] = None):
        if layers is None:
            layers = list(config.layers)
        elif isinstance(layers, int):
            layers = [layers]
        else:
            layers = list(layers)
        for layer in layers:
            if layer not in config.layers:
                raise ValueError(f"layer index {layer} is not an insertion layer; config.layers={config.layers}")
        if not layers:
            raise ValueError(f"no layers to hash: pass None (all of config.layers={config.layers}), one or several")
        self.config = config
        self.layers = layers
        layouts = branch_layouts(config)
        self.layouts = [layouts[layer] for layer in self.layers]
        self.pad_id = lookup_vocab_size(config)
        self.compression = None
        if config.token_compression is not None:
            from fe_megatron.ngram.compression import load_token_compression

            self.compression = load_token_compression(config.token_compression, config.vocab_size)
        self._constants = {}

    def total_rows(self, layer_index: int) -> int:
        return self.layouts[self.layers.index(layer_index)].total_rows

    def _device_constants(self, device: torch.device):
        if device not in self._constants:
            mult = [m for lay in self.layouts for m in lay.multipliers]
            mod = [p for lay in self.layouts for p in lay.moduli]
            off = [o for lay in self.layouts for o in lay.offsets]
            as_long = functools.partial(torch.tensor, dtype=torch.int64, device=device)
            lookup = None if self.compression is None else self.compression.lookup.to(device)
            self._constants[device] = (as_long(mult), as_long(mod), as_long(off), lookup)
        return self._constants[device]

    def indices(self, token_ids: torch.Tensor, validate: bool = True,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[batch, seq]`` ids -> ``[batch, seq, branches]`` int64 row indices; with ``position_ids`` (``[batch or
        1, seq]``) no n-gram reaches before its document's start (`within_documents`).

        With several layers, the branches of all layers are concatenated in layer order.
        """
        return self.indices_of_lookup_ids(self.lookup_ids(token_ids, validate), position_ids)

    def lookup_ids(self, token_ids: torch.Tensor, validate: bool = True) -> torch.Tensor:
        """``[batch, seq]`` token ids -> the int64 ids the addressing reads (after token compression);
        ``pad_id`` is the one id no token maps to (a position before the sequence start)."""
        if validate:
            validate_token_ids(token_ids, self.config.vocab_size)
        ids = token_ids.to(torch.int64)
        lookup = self._device_constants(token_ids.device)[3]
        return ids if lookup is None else lookup[ids]

    def indices_of_lookup_ids(self, ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Eq. 1 on ids from `lookup_ids` (``pad_id`` allowed): ``[batch, seq, branches]`` row indices.
        An incremental decoder passes the last ``max_order - 1`` ids before the new ones and drops
        their rows, so a step's cost does not grow with the context.  ``position_ids``: those of the
        last ``position_ids.shape[-1]`` positions of ``ids`` (`within_documents`)."""
        mult, mod, off, _ = self._device_constants(ids.device)
        indices = ops.ngram_hash(ids, mult, mod, off, self.pad_id)
        if position_ids is None or self.config.max_order == 1:
            return indices
        return within_documents(ids, indices, position_ids, self.config.max_order - 1, self.pad_id,
                                lambda windows: ops.ngram_hash(windows, mult, mod, off, self.pad_id)[:, -1])

    def indices_of_next_ids(self, ids: torch.Tensor, id_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Eq. 1 at one new position of each of R continuing sequences: ids ``[R]`` from `lookup_ids` after the last
        ``max_order - 1`` ids in ``id_state[slots]``, which advances in place (`fe_megatron.ops.ngram_hash_decode_`).
        Returns ``[R, branches]``."""
        mult, mod, off, _ = self._device_constants(ids.device)
        return ops.ngram_hash_decode_(ids, id_state, slots, mult, mod, off, self.pad_id)

    def indices_per_layer(self, token_ids: torch.Tensor, validate: bool = True,
                          position_ids: Optional[torch.Tensor] = None) -> dict:
        """``{layer: [batch, seq, branches]}``, hashed in one launch for all layers."""
        flat = self.indices(token_ids, validate, position_ids)
        sizes = [len(lay.orders) for lay in self.layouts]
        return dict(zip(self.layers, flat.split(sizes, dim=-1)))


def within_documents(ids: torch.Tensor, indices: torch.Tensor, position_ids: torch.Tensor, history: int, pad_id: int,
                     hash_windows: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``indices`` (Eq. 1 of ``ids`` [batch, seq], ``[batch, seq, branches]``) with every n-gram kept inside its
    document: at a position whose position id ``p`` is below ``history`` (``max_order - 1``) and below its place in
    the row (so its window holds earlier ids), the ids more than ``p`` positions back read ``pad_id``, as before a
    sequence start.

    ``position_ids`` (``[batch or 1, n]``) are those of the last ``n`` positions of ``ids`` (an incremental decoder's
    ids start with its look-back).  Only such positions are hashed again, each as a window of its own ``history
    + 1`` ids (``hash_windows``: ``[windows, history + 1]`` ids -> the last position's ``[windows, branches]``);
    inside a compiled graph, which cannot count them without a host synchronisation, every position's is."""
    batch, seq = ids.shape
    positions = position_ids.to(ids.device).expand(batch, -1)
    first = seq - positions.shape[1]  # where the positions with ids begin
    place = torch.arange(first, seq, device=ids.device)
    if torch.compiler.is_compiling():
        rows = torch.arange(batch, device=ids.device).repeat_interleave(positions.shape[1])
        columns = torch.arange(positions.shape[1], device=ids.device).repeat(batch)
    else:
        crossing = (positions < history) & (positions < place)
        rows, columns = crossing.nonzero(as_tuple=True)
        if rows.numel() == 0:
            return indices
    back = torch.arange(history, -1, -1, device=ids.device)  # window slot j reads back[j] positions back
    at = (columns + first).unsqueeze(1) - back  # [windows, history + 1]: each slot's place in the row
    inside = (back <= positions[rows, columns].unsqueeze(1)) & (at >= 0)
    windows = torch.where(inside, ids[rows.unsqueeze(1), at.clamp_min(0)], pad_id)
    fixed = indices.clone()
    fixed[rows, columns + first] = hash_windows(windows)
    return fixed
