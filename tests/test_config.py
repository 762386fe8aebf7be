import textwrap

import pytest

from fe_megatron.config import ConfigError, MemoryConfig

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
    assert MemoryConfig.from_preset("engram-340m").representation == "dense"
    assert MemoryConfig.from_preset("engram-340m").ngram_orders == [2, 3]
    assert MemoryConfig.from_preset("engram-unigram-340m").ngram_orders == [1, 2, 3]
    assert MemoryConfig.from_preset("factorengram-scalar-gate-340m").gate == "scalar"
    assert 1 not in MemoryConfig.from_preset("factorengram-no-unigram-340m").ngram_orders
    for name, lam in [("0", 0.0), ("1e-4", 1e-4), ("1e-3", 1e-3), ("1e-2", 1e-2)]:
        assert MemoryConfig.from_preset(f"factorengram-340m-lambda-{name}").sparsity_lambda == lam


def test_from_preset_overrides_and_unknown():
    c = MemoryConfig.from_preset("factorengram-340m", layers=[12], sparsity_lambda=0.0)
    assert c.layers == [12] and c.sparsity_lambda == 0.0
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        MemoryConfig.from_preset("nope")


@pytest.mark.parametrize("overrides, field, fragment", [
    (dict(layers=[24]), "layers", "layer 24 is outside [0, 23]"),
    (dict(layers=[-1]), "layers", "outside [0, 23]"),
    (dict(layers=[3, 3]), "layers", "twice"),
    (dict(coeff_width=3070), "coeff_width", "3070 is not divisible by the 12 branches"),
    (dict(placement="after_attn"), "placement", "'after_attn' is not one of"),
    (dict(gate="vector"), "gate", "'vector' is not one of"),
    (dict(representation="sparse"), "representation", "'sparse' is not one of"),
    (dict(representation="dense"), "gate", "'basis' gates dictionary coefficients"),
    (dict(representation="dense", gate="scalar", memory_dim=1024), "memory_dim", "must equal coeff_width=3072"),
    (dict(sparsity_lambda=-1e-3), "sparsity_lambda", "-0.001 must be a finite number >= 0"),
    (dict(heads_per_order=[4, 4]), "heads_per_order", "expected one per order"),
    (dict(table_capacity=[32000, 250_000]), "table_capacity", "expected one per order"),
    (dict(table_capacity=[1000, 250_000, 250_000]), "table_capacity", "unigram capacity 1000 is below vocab_size=32000"),
    (dict(ngram_orders=[3, 2, 1]), "ngram_orders", "increasing order"),
    (dict(ngram_orders=[0, 2, 3]), "ngram_orders", ">= 1"),
    (dict(hidden_size=0), "hidden_size", "0 must be an integer >= 1"),
    (dict(conv_kernel_size=2.5), "conv_kernel_size", "2.5 must be an integer"),
    (dict(layers="10"), "layers", "must be a list of integers"),
])
def test_invalid_values_name_the_field_and_range(overrides, field, fragment):
    with pytest.raises(ConfigError) as info:
        MemoryConfig.from_preset("factorengram-340m", **overrides)
    assert info.value.field == field
    assert fragment in str(info.value)
    assert f"MemoryConfig.{field}" in str(info.value)


def test_yaml_roundtrip_and_preset(tmp_path):
    path = tmp_path / "mem.yaml"
    path.write_text(textwrap.dedent("""\
        memory:
          preset: factorengram-340m
          layers: [11]
          sparsity_lambda: 1.0e-4
    """))
    c = MemoryConfig.from_yaml(path, key="memory")
    assert c.layers == [11] and c.sparsity_lambda == 1e-4 and c.memory_dim == 3072
    path2 = tmp_path / "flat.yaml"
    import yaml

    path2.write_text(yaml.safe_dump(c.to_dict()))
    assert MemoryConfig.from_yaml(path2) == c


def test_yaml_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("preset: factorengram-340m\nplacement: before_attn\nlayers: [10, 40]\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3: MemoryConfig.layers: layer 40 is outside \[0, 23\]"):
        MemoryConfig.from_yaml(path)
    path.write_text("vocab_size: 100\nhiden_size: 12\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: MemoryConfig.hiden_size: unknown field"):
        MemoryConfig.from_yaml(path)
    path.write_text("layers: [1, 2\n")
    with pytest.raises(ValueError, match="invalid YAML"):
        MemoryConfig.from_yaml(path)
