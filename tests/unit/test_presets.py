"""`fe_megatron.presets`: the paper's presets and ablations exist, build, and name their backbone once."""

from fe_megatron.config import BackboneConfig, MemoryConfig


REQUIRED_PRESETS = ["factorengram-340m", "factorengram-1b", "engram-340m", "engram-unigram-340m",
                    "factorengram-scalar-gate-340m", "factorengram-no-unigram-340m",
                    "factorengram-340m-lambda-0", "factorengram-340m-lambda-1e-4",
                    "factorengram-340m-lambda-1e-3", "factorengram-340m-lambda-1e-2"]


def test_required_presets_exist_and_build():
    names = MemoryConfig.preset_names()
    for name in REQUIRED_PRESETS:
        assert name in names
    for name in names:
        MemoryConfig.from_preset(name)


def test_table8_340m_preset_matches_paper():
    c = MemoryConfig.from_preset("factorengram-340m")
    assert (c.hidden_size, c.num_layers, c.vocab_size) == (1024, 24, 32000)
    assert c.table_capacity == [32000, 250_000, 250_000]
    assert (c.memory_dim, c.coeff_width, c.heads_per_order, c.layers) == (3072, 3072, [4, 4, 4], [10, 12])
    assert (c.ngram_orders, c.placement, c.sparsity_lambda, c.gate) == ([1, 2, 3], "before_attn", 1e-3, "basis")
    assert c.branch_orders == [1] * 4 + [2] * 4 + [3] * 4 and c.branch_width == 256


def test_ablation_presets():
    assert MemoryConfig.from_preset("factorengram-1b").table_capacity == [32000, 250_000, 750_000]
    assert MemoryConfig.from_preset("engram-340m").kind == "engram"
    assert MemoryConfig.from_preset("engram-340m").ngram_orders == [2, 3]
    assert MemoryConfig.from_preset("engram-unigram-340m").ngram_orders == [1, 2, 3]
    assert MemoryConfig.from_preset("factorengram-scalar-gate-340m").gate == "scalar"
    assert 1 not in MemoryConfig.from_preset("factorengram-no-unigram-340m").ngram_orders
    for name, lam in [("0", 0.0), ("1e-4", 1e-4), ("1e-3", 1e-3), ("1e-2", 1e-2)]:
        assert MemoryConfig.from_preset(f"factorengram-340m-lambda-{name}").sparsity_lambda == lam


def test_backbone_is_written_once_presets_name_it():
    from fe_megatron.presets import BACKBONES, PRESETS

    assert all("hidden_size" not in values for values in PRESETS.values())
    assert all(values["backbone"] in BACKBONES for values in PRESETS.values())
    c = MemoryConfig.from_preset("factorengram-1b")
    assert (c.hidden_size, c.ffn_hidden_size) == (2048, 5632) and c.backbone == BackboneConfig(**BACKBONES["1b"])
