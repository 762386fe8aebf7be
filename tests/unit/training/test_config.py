"""The training config (`fe_megatron.training.config`): errors labelled with their section and naming
the file, line or override; the closest known key for a mistyped one; the DeepSpeed JSON an override
reaches into; the model section as the memory's backbone; every example config loads; an MoE
backbone's settings and the table storage training accepts."""

import os
import re

import pytest

from fe_megatron.config import ConfigError
from fe_megatron.training.config import load_train_config
from tests.helpers.training import CONFIG, ROOT, small_overrides


@pytest.mark.parametrize("overrides, field", [
    (["memory.kind=mamba"], "memory.kind"),
    (["memory.hidden_size=64"], "memory.hidden_size"),
    (["memory.backbone=tiny"], "memory.backbone"),
    (["model.hidden_size=0"], "model.hidden_size"),
    (["model.preset=huge"], "model.preset"),
    (["training.bogus=1"], "training.bogus"),
    (["optimizer.warmup_steps=500"], "optimizer.warmup_steps"),
    (["memory.kind=engram"], "memory.gate"),
    (["memory.preset=nope"], "memory.preset"),
    (["training.kernel_backend=fortran"], "training.kernel_backend"),
    (["memory=null", "memory.layers=[1]"], "memory.layers"),
    (["parallel.distributed_timeout_minutes=0"], "parallel.distributed_timeout_minutes"),
    # every field of the field sections is checked for its type before a check computes with it
    (["training.train_steps=abc"], "training.train_steps"),
    (["training.train_steps=1.5"], "training.train_steps"),
    (["optimizer.lr=fast"], "optimizer.lr"),
    (["training.keep_checkpoints=-1"], "training.keep_checkpoints"),
    (["data.train_data=[0.5,a,heavy,b]"], "data.train_data"),
])
def test_train_config_errors(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_train_config(CONFIG, overrides)
    assert info.value.path == field
    # training-config errors are labelled with their section, not with a class name
    assert re.search(rf"(^|: ){re.escape(field)}: ", str(info.value)) and not str(info.value).startswith("Memory")


@pytest.mark.parametrize("override, answer", [
    ("training.trian_steps=30", "training.trian_steps: unknown field; did you mean training.train_steps?"),
    ("optimiser.lr=1e-3", "override 'optimiser.lr=1e-3': optimiser: unknown section; did you mean optimizer? "
                          "(known: data, deepspeed, load, memory, model, optimizer, parallel, save, tensorboard_dir, "
                          "training)"),
    ("training.lr=1e-3", "training.lr: unknown field; lr is a field of optimizer: did you mean optimizer.lr?"),
    ("training.zzz=1", "training.zzz: unknown field (known: deterministic_table_grads, engine, "),
    # a value one field takes names that field, whatever the key's spelling
    ("memory.tables=rowwise_adagrad", "memory.tables: unknown field; rowwise_adagrad is a value of "
                                      "optimizer.table_update: did you mean optimizer.table_update=rowwise_adagrad?"),
    ("optimizer.dtype=bf16", "optimizer.dtype: unknown field; bf16 is a value of memory.table_dtype and of "
                             "optimizer.table_state_dtype: did you mean memory.table_dtype=bf16 or "
                             "optimizer.table_state_dtype=bf16?"),
])
def test_a_mistyped_key_is_answered_with_the_closest_known_one(override, answer):
    with pytest.raises(ConfigError) as info:
        load_train_config(CONFIG, [override])
    assert answer in str(info.value)
    if "did you mean training." in answer:  # the section's 20 fields are not listed beside the answer
        assert "(known:" not in str(info.value)


@pytest.mark.parametrize("override, message", [
    ("training.train_steps=abc", "training.train_steps: 'abc' must be an integer >= 1"),
    ("training.train_steps=1.5", "training.train_steps: 1.5 must be an integer >= 1"),
    ("optimizer.lr=fast", "optimizer.lr: 'fast' must be a finite number > 0"),
    ("optimizer.beta2=1", "optimizer.beta2: 1 must be a finite number in [0, 1)"),
    ("parallel.sequence_parallel=yes please", "parallel.sequence_parallel: 'yes please' must be true or false"),
    ("data.split=98", "data.split: 98 must be a string"),
    ("data.train_data=[0.5,a,heavy,b]", "must be one indexed-dataset prefix (data.train_data=PREFIX"),
])
def test_every_field_is_refused_by_its_type_and_range(override, message):
    with pytest.raises(ConfigError) as info:
        load_train_config(CONFIG, [override])
    assert message in str(info.value) and f"override '{override}'" in str(info.value)


def test_a_bare_prefix_is_one_dataset():
    assert load_train_config(CONFIG, ["data.train_data=some/prefix"]).data.train_data == ["some/prefix"]


def test_train_config_error_names_the_file_line_or_override(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(open(CONFIG).read().replace("warmup_steps: 20", "warmup_steps: 900"))
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: optimizer.warmup_steps: 900 must lie in \[0, "):
        load_train_config(str(path))
    with pytest.raises(ConfigError, match=r"override 'memory.layers=\[7\]': memory.layers: layer 7 is outside"):
        load_train_config(CONFIG, ["memory.layers=[7]"])


def test_a_check_across_fields_names_the_override_that_broke_it():
    with pytest.raises(ConfigError, match=r"demo_cpu.yaml:\d+: optimizer.warmup_steps: 20 must lie in \[0, "
                                          r"training.train_steps=5\) \(set by the override 'training.train_steps=5'\)"):
        load_train_config(CONFIG, ["training.train_steps=5"])


def test_an_override_reaches_into_the_deepspeed_json_file_the_config_names(tmp_path):
    ds_config = os.path.join(ROOT, "examples", "configs", "demo_cpu_deepspeed.yaml")
    cfg = load_train_config(ds_config, ["deepspeed.zero_optimization.stage=2"])
    assert cfg.deepspeed["zero_optimization"]["stage"] == 2 and cfg.deepspeed["train_batch_size"] == "auto"
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(ds_config).read().replace("examples/configs/deepspeed_zero3.json", str(tmp_path / "no.json")))
    with pytest.raises(ConfigError, match=r"the override 'deepspeed.zero_optimization.stage=2' reaches into "
                                          r".*no.json, which cannot be read as JSON"):
        load_train_config(str(bad), ["deepspeed.zero_optimization.stage=2"])


def test_model_section_is_the_memory_backbone():
    cfg = load_train_config(CONFIG, ["model.hidden_size=64", "model.num_attention_heads=2"])
    assert cfg.memory.backbone is cfg.model and cfg.memory.hidden_size == 64 and cfg.model_kind == "factorengram"
    assert load_train_config(CONFIG, ["memory=null"]).model_kind == "transformer"


def test_paper_configs_load():
    folder = os.path.join(ROOT, "examples", "configs")
    names = [n for n in os.listdir(folder) if n.endswith(".yaml")]
    assert len(names) >= 8
    for name in names:
        cfg = load_train_config(os.path.join(folder, name))
        if name.startswith("paper_340m"):
            assert cfg.model.hidden_size == 1024 and cfg.model.seq_length == 8192


@pytest.mark.parametrize("overrides, fragment", [
    (["model.num_experts=-1"], "model.num_experts: -1 must be an integer >= 0"),
    (["model.num_experts=4", "model.moe_router_topk=5"], "model.moe_router_topk: 5 exceeds num_experts=4"),
    (["model.num_experts=4", "parallel.expert=3"], "parallel.expert: 3 must divide model.num_experts=4"),
    (["parallel.expert=2"], "parallel.expert: 2 must divide model.num_experts=0"),
    (["model.num_experts=4", "training.engine=deepspeed"], "model.num_experts: 4: the DeepSpeed engine trains the "
                                                           "Hugging Face model, whose FFN is dense"),
])
def test_an_moe_backbone_s_settings_are_checked_by_name(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_train_config(CONFIG, overrides)
    moe = load_train_config(CONFIG, ["model.num_experts=4", "parallel.expert=2"])
    assert (moe.model.num_experts, moe.model.moe_router_topk, moe.parallel.expert) == (4, 2, 2)


@pytest.mark.parametrize("overrides,message", [
    ({"memory.table_dtype": "fp8"}, r"memory.table_dtype: 'fp8' is a serving format \(fe-convert --table-dtype fp8\); "
                                    r"fe-pretrain trains fp32 or bf16 tables"),
    ({"memory.table_dtype": "bf16", "training.engine": "deepspeed", "parallel.table_sharding": "zero"},
     r"parallel.table_sharding: 'zero' keeps the tables as ZeRO's parameters, which cannot hold "
     r"memory.table_dtype=bf16; use table_sharding rows"),
    ({"memory.table_placement": "host", "training.engine": "deepspeed", "parallel.table_sharding": "zero"},
     r"cannot hold memory.table_placement=host"),
    ({"optimizer.table_state_dtype": "fp16"}, r"optimizer.table_state_dtype: 'fp16' is not one of \('fp32', 'bf16'\)"),
    ({"memory.table_placement": "disk"}, r"memory.table_placement: 'disk' is not one of \('device', 'host'\)"),
])
def test_training_refuses_table_storage_it_cannot_train(small_data, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(CONFIG, small_overrides(small_data, **overrides))


@pytest.mark.parametrize("engine,sharding", [("megatron", "replicated"), ("megatron", "rows"),
                                             ("deepspeed", "rows"), ("deepspeed", "replicated")])
def test_every_engine_and_sharding_accepts_bf16_tables_in_either_placement(small_data, engine, sharding):
    """The configuration only: each engine and table sharding takes bf16 tables with bf16 state on the
    device and in host memory, and keeps them in stores.  Training them is tested by fe-pretrain runs
    (tests/integration/test_table_stores.py, test_deepspeed.py)."""
    from fe_megatron.tables.plan import TablePlan

    for placement in ("device", "host"):
        cfg = load_train_config(CONFIG, small_overrides(small_data, **{
            "memory.table_dtype": "bf16", "memory.table_placement": placement, "optimizer.table_state_dtype": "bf16",
            "training.engine": engine, "parallel.table_sharding": sharding}))
        assert (cfg.memory.table_dtype, cfg.memory.table_placement, cfg.optimizer.table_state_dtype) == \
            ("bf16", placement, "bf16")
        assert (cfg.training.engine, cfg.parallel.table_sharding) == (engine, sharding)
        plan = TablePlan.for_run(cfg)
        assert plan.trainer == "stores" and plan.in_stores, plan.describe()
