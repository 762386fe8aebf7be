"""The n-gram hash's frozen golden vectors and its definition token by token in Python integers,
independent of the vectorized hasher and of every kernel backend."""

from fe_megatron.config import BackboneConfig
from fe_megatron.ngram import branch_layouts

GOLDEN_CONFIG = dict(backbone=BackboneConfig(vocab_size=1000, hidden_size=32, num_layers=4, num_attention_heads=4,
                                             ffn_hidden_size=64), ngram_orders=[1, 2, 3],
                     heads_per_order=2, table_capacity=[1000, 5000, 7000], coeff_width=24, memory_dim=16,
                     layers=[0, 2], hash_seed=42)
GOLDEN_IDS = [[5, 17, 999, 0, 5, 17, 999, 3]]
# Frozen expected output: these must never change, on any machine or release.
GOLDEN_INDICES = [[
    [5, 1005, 2421, 10005, 15452, 20955, 5, 1005, 4444, 11808, 16554, 21794],
    [17, 1017, 6487, 7611, 13699, 21807, 17, 1017, 2043, 9000, 12374, 21209],
    [999, 1999, 2288, 10092, 13767, 24540, 999, 1999, 3635, 10985, 13262, 22679],
    [0, 1000, 2106, 10206, 18367, 25517, 0, 1000, 2754, 11941, 15347, 23347],
    [5, 1005, 6631, 9187, 12222, 25941, 5, 1005, 6290, 11286, 18741, 24931],
    [17, 1017, 6487, 7611, 14601, 20392, 17, 1017, 2043, 9000, 17045, 21131],
    [999, 1999, 2288, 10092, 13767, 24540, 999, 1999, 3635, 10985, 13262, 22679],
    [3, 1003, 4176, 8681, 18286, 20460, 3, 1003, 2271, 8205, 15635, 23494],
]]


def python_reference_indices(config, layer, ids):
    """Token-by-token hashing with Python's unbounded ints: independent of the vectorized kernel."""
    lay = branch_layouts(config)[layer]
    pad = config.vocab_size
    out = []
    for row in ids:
        seq = []
        for t in range(len(row)):
            per_branch = []
            for n, mult, mod, off in zip(lay.orders, lay.multipliers, lay.moduli, lay.offsets):
                if n == 1:
                    per_branch.append(row[t] + off)
                    continue
                mix = 0
                for k in range(n):
                    token = row[t - k] if t - k >= 0 else pad
                    product = token * mult[k]
                    assert product < 2 ** 63  # the multiplier bound really prevents int64 overflow
                    mix ^= product
                per_branch.append(mix % mod + off)
            seq.append(per_branch)
        out.append(seq)
    return out
