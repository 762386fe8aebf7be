"""`fe_megatron.config`: MemoryConfig and BackboneConfig, their checks and error messages, YAML in and out."""

import textwrap

import pytest

from fe_megatron.config import ConfigError, MemoryConfig


def test_from_preset_overrides_and_unknown():
    c = MemoryConfig.from_preset("factorengram-340m", layers=[12], sparsity_lambda=0.0)
    assert c.layers == [12] and c.sparsity_lambda == 0.0
    with pytest.raises(ConfigError, match="unknown memory preset 'nope'"):
        MemoryConfig.from_preset("nope")


@pytest.mark.parametrize("overrides, field, fragment", [
    (dict(layers=[24]), "layers", "layer 24 is outside [0, 23]"),
    (dict(layers=[-1]), "layers", "outside [0, 23]"),
    (dict(layers=[3, 3]), "layers", "twice"),
    (dict(coeff_width=3070), "coeff_width", "3070 is not divisible by the 12 branches"),
    (dict(placement="after_attn"), "placement", "'after_attn' is not one of"),
    (dict(gate="vector"), "gate", "'vector' is not one of"),
    (dict(kind="sparse"), "kind", "'sparse' is not one of"),
    (dict(kind="engram"), "gate", "'basis' gates dictionary coefficients"),
    (dict(kind="engram", gate="scalar", memory_dim=1024), "memory_dim", "must equal coeff_width=3072"),
    (dict(sparsity_lambda=-1e-3), "sparsity_lambda", "-0.001 must be a finite number >= 0"),
    (dict(heads_per_order=[4, 4]), "heads_per_order", "expected one per order"),
    (dict(table_capacity=[32000, 250_000]), "table_capacity", "expected one per order"),
    (dict(table_capacity=[1000, 250_000, 250_000]), "table_capacity", "unigram capacity 1000 is below vocab_size=32000"),
    (dict(ngram_orders=[3, 2, 1]), "ngram_orders", "increasing order"),
    (dict(ngram_orders=[0, 2, 3]), "ngram_orders", ">= 1"),
    (dict(hidden_size=64), "hidden_size", "is a backbone field: set it in the backbone"),
    (dict(conv_kernel_size=2.5), "conv_kernel_size", "2.5 must be an integer"),
    (dict(layers="10"), "layers", "must be a list of integers"),
])
def test_invalid_values_name_the_field_and_range(overrides, field, fragment):
    with pytest.raises(ConfigError) as info:
        MemoryConfig.from_preset("factorengram-340m", **overrides)
    assert info.value.field == field
    assert fragment in str(info.value)
    assert f"MemoryConfig.{field}" in str(info.value)


def test_a_mistyped_name_is_answered_with_the_closest_known_one():
    from fe_megatron.suggest import did_you_mean, unknown_name

    assert did_you_mean("trian_steps", ["seed", "train_steps"], prefix="training.") == \
        "; did you mean training.train_steps?"
    assert did_you_mean("Train_Steps", ["train_steps"]) == "; did you mean train_steps?"
    assert did_you_mean("zzz", ["train_steps"]) == ""
    # a long list is left out beside a suggestion, kept without one or when it is short
    many = [f"field_{i}" for i in range(20)] + ["train_steps"]
    assert unknown_name("field", "trian_steps", many) == "unknown field; did you mean train_steps?"
    assert unknown_name("field", "zzz", ["b", "a"]) == "unknown field (known: a, b)"
    assert unknown_name("section", "optimiser", ["data", "optimizer"]) == \
        "unknown section; did you mean optimizer? (known: data, optimizer)"
    with pytest.raises(ConfigError, match=r"^MemoryConfig\.layer: unknown field; did you mean layers\?$"):
        MemoryConfig.from_preset("factorengram-tiny", layer=[1])
    with pytest.raises(ConfigError, match=r"unknown memory preset 'factorengram-340M'; did you mean "
                                          r"factorengram-340m\? \(available: engram-1b, "):
        MemoryConfig.from_preset("factorengram-340M")
    with pytest.raises(ConfigError, match=r"unknown backbone 'Tiny'; did you mean tiny\? \(available: 1b, 340m, tiny\)"):
        MemoryConfig.from_preset("factorengram-tiny", backbone="Tiny")


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
    path.write_text("sparsity_lambda: 0.0\nhiden_size: 12\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: MemoryConfig.hiden_size: unknown field"):
        MemoryConfig.from_yaml(path)
    path.write_text("preset: factorengram-tiny\nvocab_size: 100\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: MemoryConfig.vocab_size: is a backbone field"):
        MemoryConfig.from_yaml(path)
    path.write_text("preset: factorengram-tiny\nbackbone:\n  preset: tiny\n  hidden_size: 0\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:4: MemoryConfig.backbone.hidden_size: 0 must be an integer"):
        MemoryConfig.from_yaml(path)
    path.write_text("layers: [1, 2\n")
    with pytest.raises(ValueError, match="invalid YAML"):
        MemoryConfig.from_yaml(path)


def test_training_config_yaml_gives_the_memory_its_model_section_as_backbone(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model:\n  preset: tiny\n  hidden_size: 64\n  num_attention_heads: 2\n"
                    "memory:\n  preset: factorengram-tiny\n  layers: [0]\n")
    c = MemoryConfig.from_yaml(path)
    assert c.hidden_size == 64 and c.backbone.num_layers == 4 and c.layers == [0]
