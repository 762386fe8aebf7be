"""`fe_megatron.deepspeed.config`: a DeepSpeed config that contradicts the training config is refused, one
that leaves values to it is completed from it, and engine settings that cannot work are refused."""

import json

import pytest

from fe_megatron.config import ConfigError
from fe_megatron.training.config import load_train_config
from tests.helpers.training import CONFIG, small_overrides

pytest.importorskip("deepspeed", reason="DeepSpeed is installed by the project's set-up (make setup)")


@pytest.mark.parametrize("ds,message", [
    ({"train_batch_size": 16}, "train_batch_size=16 contradicts training.global_batch_size=8"),
    ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu=4 contradicts training.micro_batch_size=2"),
    ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps=1 contradicts training.global_batch_size"),
    ({"gradient_clipping": 0.5}, "gradient_clipping=0.5 contradicts optimizer.clip_grad=1.0"),
    ({"bf16": {"enabled": True}}, "bf16.enabled=True contradicts training.precision='fp32'"),
    ({"fp16": {"enabled": True}}, "fp16.enabled=True contradicts training.precision='fp32'"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, "optimizer.params.lr=0.1 contradicts optimizer.lr"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type='Lamb'"),
    ({"scheduler": {"type": "WarmupLR"}}, "remove deepspeed.scheduler"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4 is not one of 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": 2, "compute_grad_norm": False}},
     "compute_grad_norm=False: fe-pretrain needs DeepSpeed's gradient norm"),
    ({"checkpoint": {"writer": {"type": "decoupled"}}}, "checkpoint.writer={'type': 'decoupled'}: fe-pretrain "
                                                       "commits every checkpoint itself"),
    ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint.use_node_local_storage=true"),
    ({"datastates_ckpt": {}}, "datastates_ckpt={}"),
])
def test_a_deepspeed_config_that_contradicts_the_training_config_is_refused(small_data, ds, message):
    from fe_megatron.deepspeed.config import resolve

    cfg = load_train_config(CONFIG, small_overrides(small_data, **{"training.engine": "deepspeed"}))
    cfg.deepspeed = ds
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        resolve(cfg, data_parallel_size=2, bf16=False)


def test_a_deepspeed_config_is_completed_from_the_training_config(small_data, tmp_path):
    from fe_megatron.deepspeed.config import resolve

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": "auto", "zero_optimization": {"stage": 3},
                                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95]}}}))
    cfg = load_train_config(CONFIG, small_overrides(small_data, **{"training.engine": "deepspeed",
                                                                   "deepspeed": str(path)}))
    ds = resolve(cfg, data_parallel_size=2, bf16=False)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
            ds["gradient_clipping"], ds["bf16"]["enabled"]) == (8, 2, 2, 1.0, False)
    assert "optimizer" not in ds and ds["zero_optimization"]["stage"] == 3
    path.write_text('{"zero_optimization": {"stage": 3},\n "train_batch_size": 8,,}')
    with pytest.raises(ConfigError, match=f"{path}:2:"):
        resolve(cfg, data_parallel_size=2, bf16=False)


@pytest.mark.parametrize("items,message", [
    (["parallel.tensor=2"], "parallel.tensor: 2: the DeepSpeed engine is data-parallel"),
    (["parallel.table_sharding=zero", "training.engine=megatron"], "'zero' .* needs training.engine=deepspeed"),
    (["deepspeed={zero_optimization: {stage: 1}}", "training.engine=megatron"], "deepspeed: is read by"),
    (["training.engine=jax"], "training.engine: 'jax' is not one of"),
])
def test_engine_settings_that_cannot_work_are_refused(small_data, items, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(CONFIG, small_overrides(small_data, **{"training.engine": "deepspeed"}) + items)
