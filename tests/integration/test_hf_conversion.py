"""Trained runs and the Hugging Face model: conversion both ways with equal logits, quantized tables for
serving, continued pretraining from a conversion or a graft, lm-evaluation-harness on a converted model,
and a damaged checkpoint not converted."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from fe_megatron.convert.common import ConversionError
from fe_megatron.convert.graft import graft
from fe_megatron.convert.to_hf import mcore_to_hf
from fe_megatron.convert.to_mcore import hf_to_mcore
from tests.helpers.torchrun_util import megatron_logits
from tests.helpers.training import CONFIG, run_pretrain, small_overrides


# ----------------------------------------------------------------------------- conversion
@pytest.fixture(scope="module")
def trained_runs(small_data, tmp_path_factory):
    """The demo config trained 4 steps at TP=1, at TP=2 (GQA backbone, inside_ffn, so that the
    attention's and the SwiGLU's layouts are exercised), at DP=2 with row-sharded tables, and
    without memory (Megatron then stores the layers stacked)."""
    base = tmp_path_factory.mktemp("hf")
    runs = {}
    for name, nproc, extra in ((1, 1, {}),
                               (2, 2, {"parallel.tensor": 2, "memory.placement": "inside_ffn",
                                       "model.num_query_groups": 2}),
                               ("rows", 2, {"parallel.table_sharding": "rows"}),
                               ("plain", 1, {"memory": "null"})):
        run = str(base / f"run_{name}")
        overrides = small_overrides(small_data, **{"training.train_steps": 4, "training.save_interval": 4,
                                                   "optimizer.lr": 3e-3, **extra})
        run_pretrain(["--config", CONFIG, "--save", run] + overrides, nproc=nproc)
        runs[name] = run
    return runs


@pytest.mark.parametrize("run", [1, 2, "rows", "plain"])
def test_converted_logits_equal_megatron(trained_runs, tmp_path, run):
    from transformers import AutoModelForCausalLM

    tp = 2 if run == 2 else 1  # the row-sharded checkpoint is read back into one process
    hf_dir = mcore_to_hf(trained_runs[run], str(tmp_path / "hf"))
    names = sorted(os.listdir(hf_dir))
    assert {"config.json", "model.safetensors", "modeling_fe_megatron.py", "configuration_fe_megatron.py",
            "tokenizer.json", "tokenizer.model"} <= set(names), names
    tokens = torch.randint(0, 512, (2, 48))
    expected = megatron_logits(trained_runs[run], tokens, tp, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        got = model(tokens).logits
    assert (got - expected).abs().max() < 1e-5, (got - expected).abs().max()
    if run != "plain":
        memory = model.model.layers[model.config.memory["layers"][0]].memory
        assert memory.value_proj.weight.abs().sum() > 0  # trained: the memory contributes


@pytest.mark.parametrize("table_dtype,stored,max_loss_change", [("bf16", torch.bfloat16, 1e-3),
                                                                   ("fp8", torch.float8_e4m3fn, 1e-2)])
def test_quantized_tables_serve_the_trained_model(trained_runs, tmp_path, table_dtype, stored, max_loss_change):
    """fe-convert --table-dtype: the tables are stored quantized (smaller on disk), the model loads
    and generates with them, its loss stays close to fp32 tables', and training refuses fp8 ones."""
    from transformers import AutoModelForCausalLM

    full = mcore_to_hf(trained_runs[1], str(tmp_path / "fp32"))
    quantized = mcore_to_hf(trained_runs[1], str(tmp_path / table_dtype), table_dtype=table_dtype)
    tokens = torch.randint(3, 512, (4, 64))
    losses = {}
    for name, directory in (("fp32", full), (table_dtype, quantized)):
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
        with torch.no_grad():
            losses[name] = model(tokens, labels=tokens).loss.item()
        tables = model.model.layers[model.config.memory["layers"][0]].memory.tables
        assert tables.weight.dtype == (torch.float32 if name == "fp32" else stored)
    assert hasattr(tables, "row_scale") == (table_dtype == "fp8")
    assert model.config.memory["table_dtype"] == table_dtype
    assert abs(losses[table_dtype] - losses["fp32"]) <= max_loss_change * losses["fp32"], losses
    assert model.generate(tokens[:1, :8], max_new_tokens=6, do_sample=False).shape == (1, 14)
    table_bytes = {name: sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
                             if f.endswith(".safetensors")) for name, directory in (("fp32", full),
                                                                                  (table_dtype, quantized))}
    assert table_bytes[table_dtype] < table_bytes["fp32"]
    if table_dtype == "fp8":
        with pytest.raises(ConversionError, match="stores its tables as fp8, a serving format"):
            hf_to_mcore(quantized, str(tmp_path / "back"))
    else:  # bf16 tables also train (from table stores): back to a run that keeps them in bf16
        with open(os.path.join(hf_to_mcore(quantized, str(tmp_path / "back")), "train.yaml")) as fh:
            assert yaml.safe_load(fh)["memory"]["table_dtype"] == "bf16"


def test_round_trip_is_bit_exact_and_training_continues(trained_runs, small_data, tmp_path):
    from safetensors.torch import load_file

    from fe_megatron.convert.megatron_reader import DistCheckpoint

    hf_dir = mcore_to_hf(trained_runs[2], str(tmp_path / "hf"))
    run = hf_to_mcore(hf_dir, str(tmp_path / "run"), tp=2)
    again = mcore_to_hf(run, str(tmp_path / "hf2"))
    first, second = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(again,
                                                                                                "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    # every weight of the converted run equals the trained run's, bit for bit
    trained = DistCheckpoint(os.path.join(trained_runs[2], "iter_0000004"))
    converted = DistCheckpoint(os.path.join(run, "iter_0000000"))
    names = converted.weight_names()
    assert sorted(names) == sorted(trained.weight_names()) and len(names) > 10
    assert all(torch.equal(converted.load(name), trained.load(name)) for name in names)
    # fe-pretrain continues from it at TP=2, with a fresh optimizer, from step 0
    with open(os.path.join(run, "train.yaml")) as fh:
        assert "tensor: 2" in fh.read()
    overrides = small_overrides(small_data, **{"training.train_steps": 2, "training.save_interval": 2,
                                               "optimizer.warmup_steps": 1, "training.eval_interval": 2,
                                               "data.split": "90,5,5",
                                               "parallel.tensor": 2, "memory.placement": "inside_ffn",
                                               "model.num_query_groups": 2})
    overrides = [o for o in overrides if not o.startswith("data.tokenizer_model=")]
    proc = run_pretrain(["--config", os.path.join(run, "train.yaml"), "--load", run, "--save", run] + overrides,
                        nproc=2)
    assert "a converted checkpoint: no optimizer state" in proc.stdout and "starts at step 0" in proc.stdout
    assert open(os.path.join(run, "latest_checkpointed_iteration.txt")).read().strip() == "2"


def test_hf_to_mcore_carries_the_runs_training_settings_or_writes_short_placeholders(trained_runs, small_data,
                                                                                     base_llama, tmp_path):
    import yaml

    from fe_megatron.convert.cli import main as fe_convert

    hf_dir = mcore_to_hf(trained_runs[1], str(tmp_path / "hf"))
    assert json.load(open(os.path.join(hf_dir, "fe_training.json")))["config"]["training"]["train_steps"] == 4
    run = hf_to_mcore(hf_dir, str(tmp_path / "run"))
    text = open(os.path.join(run, "train.yaml")).read()
    carried = yaml.safe_load(text)
    assert carried["training"]["train_steps"] == 4 and carried["optimizer"]["lr"] == 3e-3
    trained = json.load(open(os.path.join(trained_runs[1], "iter_0000004", "fe_run.json")))["config"]
    assert carried["data"]["train_data"] == [small_data["prefix"]] and carried["data"] | {"tokenizer_model": None} == \
        trained["data"] | {"tokenizer_model": None}
    assert "with the training settings of the run it was converted from" in text
    assert carried["training"]["exit_after"] == 0 and carried["parallel"]["table_sharding"] == "replicated"
    rows = yaml.safe_load(open(os.path.join(hf_to_mcore(hf_dir, str(tmp_path / "rows"), table_sharding="rows"),
                                            "train.yaml")))
    assert rows["parallel"]["table_sharding"] == "rows"  # the command line wins over the run's setting
    # a model that records no run (a Llama, a graft): short placeholders, and what to set
    grafted = graft(base_llama, "factorengram-tiny", str(tmp_path / "graft"), layers=[1, 2])
    text = open(os.path.join(grafted, "train.yaml")).read()
    placeholder = yaml.safe_load(text)
    assert placeholder["training"]["train_steps"] == 1000 and placeholder["training"]["global_batch_size"] == 8
    assert placeholder["optimizer"]["warmup_steps"] == 100 and placeholder["data"]["split"] == "90,5,5"
    assert "short placeholders, not a recipe" in text and "Set data.train_data" in text
    hf_llama = str(tmp_path / "llama_run")
    assert fe_convert(["hf-to-mcore", "--input", base_llama, "--output", hf_llama]) == 0
    assert "short placeholders" in open(os.path.join(hf_llama, "train.yaml")).read()


# ----------------------------------------------------------------------------- graft
def test_graft_starts_at_the_base_models_logits(base_llama, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    run = graft(base_llama, "factorengram-tiny", str(tmp_path / "run"), layers=[1, 3])
    with open(os.path.join(run, "iter_0000000", "fe_run.json")) as fh:
        info = json.load(fh)
    assert info["config"]["model"]["num_query_groups"] == 2 and info["config"]["memory"]["layers"] == [1, 3]
    assert info["config"]["memory"]["table_capacity"][0] >= 512  # the unigram table covers the base vocabulary
    hf_dir = mcore_to_hf(run, str(tmp_path / "hf"))
    tokens = torch.randint(0, 512, (2, 32))
    base = LlamaForCausalLM.from_pretrained(base_llama).eval()
    grafted = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        assert (grafted(tokens).logits - base(tokens).logits).abs().max() < 1e-5
    megatron = megatron_logits(run, tokens, 1, tmp_path)
    assert (megatron - base(tokens).logits).abs().max() < 1e-5


def test_continued_pretraining_can_train_the_memory_only(base_llama, small_data, tmp_path):
    from safetensors.torch import load_file

    run = graft(base_llama, "factorengram-tiny", str(tmp_path / "run"), layers=[1, 2])
    overrides = [f"data.train_data=[{small_data['prefix']}]", "training.train_steps=2", "training.save_interval=2",
                 "training.eval_interval=2", "training.eval_steps=1", "training.micro_batch_size=2",
                 "training.global_batch_size=4", "model.seq_length=64", "optimizer.warmup_steps=1",
                 "optimizer.lr=1e-2", "training.freeze_backbone=true", "data.split=90,5,5"]
    run_pretrain(["--config", os.path.join(run, "train.yaml"), "--load", run, "--save", run] + overrides)
    before = load_file(os.path.join(mcore_to_hf(run, str(tmp_path / "hf0"), iteration=0), "model.safetensors"))
    after = load_file(os.path.join(mcore_to_hf(run, str(tmp_path / "hf2"), iteration=2), "model.safetensors"))
    backbone = [k for k in before if ".memory." not in k]
    memory = [k for k in before if ".memory.value_proj" in k]
    assert backbone and all(torch.equal(before[k], after[k]) for k in backbone)
    assert memory and all(not torch.equal(before[k], after[k]) for k in memory)


# ----------------------------------------------------------------------------- lm-evaluation-harness
def write_multiple_choice_files(folder):
    """Small files in the formats of the evaluation sets (docs/evaluation.md), made up here: this
    test checks the plumbing from a converted model through lm-evaluation-harness, not a score."""
    import random

    folder.mkdir()
    rng = random.Random(5)
    words = ["river", "stone", "music", "winter", "garden", "letter", "engine", "market", "candle", "forest"]

    def phrase(n):
        return " ".join(rng.choice(words) for _ in range(n))

    files = {
        "social_iqa.jsonl": [{"id": f"s{i}", "context_question": phrase(8) + "?", "choices": [phrase(2) for _ in range(3)],
                              "label": rng.randrange(3)} for i in range(8)],
        "arc_like.jsonl": [{"id": f"a{i}", "context_question": phrase(9) + "?", "choices": [phrase(3) for _ in range(4)],
                            "label": rng.randrange(4)} for i in range(8)],
        "winogrande_pairs.jsonl": [{"id": f"w{i}", "sentence": f"The {phrase(2)} left the _ for the {phrase(1)}.",
                                    "option1": rng.choice(words), "option2": rng.choice(words),
                                    "label": rng.randrange(1, 3)} for i in range(8)],
    }
    for name, records in files.items():
        (folder / name).write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def test_lm_eval_runs_the_local_tasks_on_a_converted_model(trained_runs, tmp_path):
    pytest.importorskip("lm_eval", reason="needs lm-eval (the test extra installs it)")
    from fe_megatron.hf.lm_eval_tasks import write_tasks

    eval_dir = write_multiple_choice_files(tmp_path / "eval")
    tasks = write_tasks(str(eval_dir), str(tmp_path / "tasks"))
    assert tasks == ["fe_social_iqa", "fe_arc_like", "fe_winogrande"]
    hf_dir = mcore_to_hf(trained_runs[1], str(tmp_path / "hf"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={hf_dir},trust_remote_code=True,dtype=float32", "--include_path",
                           str(tmp_path / "tasks"), "--tasks", "fe_arc_like,fe_winogrande", "--limit", "6",
                           "--device", "cpu", "--batch_size", "2", "--output_path", str(tmp_path / "results")],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [result_file] = [os.path.join(root, name) for root, _, names in os.walk(tmp_path / "results") for name in names
                     if name.startswith("results")]
    results = json.load(open(result_file))["results"]
    assert 0.0 <= results["fe_arc_like"]["acc,none"] <= 1.0 and 0.0 <= results["fe_winogrande"]["acc,none"] <= 1.0
    assert json.load(open(result_file))["n-samples"]["fe_winogrande"]["effective"] == 6


def test_a_damaged_checkpoint_is_not_converted(trained_runs, tmp_path):
    import shutil

    from fe_megatron.checkpoint.files import MANIFEST, CheckpointError

    run = tmp_path / "run"
    shutil.copytree(trained_runs[1], run)
    (run / "iter_0000004" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"{MANIFEST}: missing"):
        mcore_to_hf(str(run), str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "hf.tmp")
