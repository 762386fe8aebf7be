"""Named backbones and memory presets reproducing the paper's configurations.

Backbones (`BACKBONES`, Table 8): 24 layers, 32K vocabulary, 8K context; SwiGLU width 8/3 d
rounded up to a multiple of 256 (Llama convention), tied input/output embeddings.
``tiny`` is a laptop-sized backbone for the bundled CPU demo and tests.

Memory presets (`PRESETS`), each naming the backbone it was defined for:

* ``factorengram-340m`` / ``factorengram-1b``: Table 8 (Appendix B.1).
* ``engram-1b``: Table 2's 1B Engram row (the 1B tables without unigrams, scalar gate).
* ``engram-340m``, ``engram-unigram-340m``, ``factorengram-scalar-gate-340m``,
  ``factorengram-no-unigram-340m``: the component ablations of Table 3.
* ``factorengram-340m-lambda-{0,1e-4,1e-3,1e-2}``: the sparsity sweep of Table 4.
* ``factorengram-340m-{before-ffn,inside-ffn}``: the placement study of Table 5.
* ``factorengram-tiny``: the memory of the CPU demo.

Table capacities are entry counts per head; hashed heads round up to distinct primes (see
`fe_megatron.ngram`).  Ablations keep every remaining branch's table identical (capacity and
width ``s_b = 256``), so "-unigram" and Engram drop exactly the unigram tables: their
coefficient width becomes 8 x 256 = 2048.
"""

BACKBONES = {
    "340m": dict(vocab_size=32000, hidden_size=1024, num_layers=24, num_attention_heads=16, ffn_hidden_size=2816,
                 seq_length=8192),
    "1b": dict(vocab_size=32000, hidden_size=2048, num_layers=24, num_attention_heads=16, ffn_hidden_size=5632,
               seq_length=8192),
    "tiny": dict(vocab_size=4096, hidden_size=128, num_layers=4, num_attention_heads=4, ffn_hidden_size=384,
                 seq_length=128),
}

_BASE_340M = dict(
    backbone="340m", kind="factorengram",
    ngram_orders=[1, 2, 3], heads_per_order=4, table_capacity=[32000, 250_000, 250_000],
    coeff_width=3072, memory_dim=3072, layers=[10, 12], placement="before_attn",
    gate="basis", sparsity_lambda=1e-3, conv_kernel_size=4, conv_dilation=3,
)

_NO_UNIGRAM = dict(ngram_orders=[2, 3], table_capacity=[250_000, 250_000], coeff_width=2048)

PRESETS = {
    "factorengram-340m": dict(_BASE_340M),
    "factorengram-1b": dict(_BASE_340M, backbone="1b", table_capacity=[32000, 250_000, 750_000], coeff_width=3840,
                            memory_dim=3840),
    # Table 3: Engram (dense hashed 2/3-gram embeddings, scalar gate), with and without unigrams.
    "engram-340m": dict(_BASE_340M, **_NO_UNIGRAM, memory_dim=2048, kind="engram", gate="scalar",
                        sparsity_lambda=0.0),
    "engram-unigram-340m": dict(_BASE_340M, kind="engram", gate="scalar", sparsity_lambda=0.0),
    # Table 2's 1B Engram row: the 1B tables without unigrams, dense rows of width s_b = 320.
    "engram-1b": dict(_BASE_340M, backbone="1b", kind="engram", gate="scalar", sparsity_lambda=0.0,
                      ngram_orders=[2, 3], table_capacity=[250_000, 750_000], coeff_width=2560, memory_dim=2560),
    "factorengram-scalar-gate-340m": dict(_BASE_340M, gate="scalar"),
    "factorengram-no-unigram-340m": dict(_BASE_340M, **_NO_UNIGRAM),
    # Table 5: within-layer placement.
    "factorengram-340m-before-ffn": dict(_BASE_340M, placement="before_ffn"),
    "factorengram-340m-inside-ffn": dict(_BASE_340M, placement="inside_ffn"),
    # A memory small enough to train on a laptop CPU in minutes.
    "factorengram-tiny": dict(
        backbone="tiny", kind="factorengram", ngram_orders=[1, 2, 3], heads_per_order=2,
        table_capacity=[4096, 16384, 16384], coeff_width=192, memory_dim=128, layers=[1, 2],
        placement="before_attn", gate="basis", sparsity_lambda=1e-3, conv_kernel_size=4, conv_dilation=3,
    ),
}
# Table 4: the sparsity sweep.
for _name, _lam in (("0", 0.0), ("1e-4", 1e-4), ("1e-3", 1e-3), ("1e-2", 1e-2)):
    PRESETS[f"factorengram-340m-lambda-{_name}"] = dict(_BASE_340M, sparsity_lambda=_lam)
