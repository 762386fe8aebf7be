"""Megatron-LM's own trainer (`fe_megatron.megatron_lm.pretrain_gpt`) against fe-pretrain's Megatron engine.

A Megatron-LM command line (SentencePiece tokenizer, a --data-path made by fe-data) trains 12 steps at
each layout; its per-step losses equal fe-pretrain's on the same model, data, seed and layout. Runs on
the newest stack (megatron-core 0.19: megatron.training); on an older one the entry point says which
release it needs.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from fe_megatron.megatron import compat
from tests.helpers.megatron_lm import MEMORY, STEPS, launch, losses, megatron_lm_arguments, memory_yaml
from tests.helpers.paths import ROOT
from tests.helpers.torchrun_util import clean_environment, failed_launch, run_in_own_session

needs_trainer = pytest.mark.skipif(not compat.has_megatron_lm_trainer(), reason=(
    f"megatron-core {compat.megatron_core_version()} has no Megatron-LM trainer (megatron.training, "
    f"{compat.TRAINER_MINIMUM} on); `make test-newest` runs these tests"))

BACKBONE = dict(vocab_size=512, hidden_size=64, num_layers=4, num_attention_heads=4, ffn_hidden_size=128,
                seq_length=64)


def fe_pretrain_config(data, tmp_path, memory=MEMORY, **sections) -> str:
    """fe-pretrain's configuration of the same model, data, optimizer and schedule."""
    config = {"model": BACKBONE, "memory": memory,
              "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "weight_decay": 0.01, "beta1": 0.9,
                            "beta2": 0.999, "eps": 1e-8, "clip_grad": 1.0},
              "training": {"train_steps": STEPS, "micro_batch_size": 2, "global_batch_size": 4, "log_interval": 1,
                           "eval_interval": 6, "eval_steps": 1, "save_interval": 6, "seed": 1234},
              "data": {"tokenizer_model": data["tokenizer"], "train_data": [data["prefix"]], "split": "90,5,5"}}
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    path = tmp_path / "fe_pretrain.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def assert_same_curve(got: dict, expected: dict, tolerance: float = 1e-5):
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1)), (sorted(got), sorted(expected))
    worst = max(abs(got[step][0] - expected[step][0]) for step in got)
    assert worst <= tolerance, {step: (got[step], expected[step]) for step in got}
    if expected[1][1] is not None:
        assert max(abs(got[step][1] - expected[step][1]) for step in got) <= tolerance
    return worst


MOE_ARGUMENTS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
                 "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"]


@needs_trainer
@pytest.mark.parametrize("layout", ["tp2", "pp2-memory-on-stage-2", "dp2-rows-rowwise-adagrad", "ep2-moe",
                                    "dp2-node-host-bf16"])
def test_layouts_match_fe_pretrain(small_data, tmp_path, layout):
    """2 processes: TP=2; PP=2 with the only memory layer on the second stage; DP=2 with row-sharded tables
    updated by a sparse rule (row-sharded tables under AdamW in this trainer: the Megatron-FSDP test of
    test_megatron_lm_recipes.py, against the distributed optimizer); an MoE backbone with 4 experts over EP=2
    beside whole tables.
    bf16 tables with bf16 state in host memory, node-shared (one copy in the node's shared memory), at DP=2.
    The table plan is fe-pretrain's: tables in stores, trained by the chain's table member, except whole
    fp32 tables updated by AdamW on a dense backbone with memory on every stage (the trainer's parameters)."""
    lm_extra, fe_sections, memory = [], {}, dict(MEMORY)
    if layout == "tp2":
        lm_extra, fe_sections = ["--tensor-model-parallel-size", "2"], {"parallel": {"tensor": 2}}
    elif layout == "pp2-memory-on-stage-2":
        memory["layers"] = [3]
        lm_extra, fe_sections = ["--pipeline-model-parallel-size", "2"], {"parallel": {"pipeline": 2}}
    elif layout == "dp2-rows-rowwise-adagrad":
        lm_extra = ["--fe-table-sharding", "rows", "--fe-table-update", "rowwise_adagrad"]
        fe_sections = {"parallel": {"table_sharding": "rows"}, "optimizer": {"table_update": "rowwise_adagrad"}}
    elif layout == "dp2-node-host-bf16":
        lm_extra = ["--fe-table-placement", "host", "--fe-table-dtype", "bf16", "--fe-table-state-dtype", "bf16",
                    "--fe-table-sharding", "node", "--fe-shared-table-folder", str(tmp_path)]
        memory.update(table_placement="host", table_dtype="bf16")
        fe_sections = {"optimizer": {"table_state_dtype": "bf16"},
                       "parallel": {"table_sharding": "node", "shared_table_folder": str(tmp_path)}}
    else:
        lm_extra = MOE_ARGUMENTS
        fe_sections = {"model": {**BACKBONE, "num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01},
                       "parallel": {"expert": 2}}
    fe_save, lm_save = str(tmp_path / "fe"), str(tmp_path / "lm")
    launch(["fe_megatron.train", "--config", fe_pretrain_config(small_data, tmp_path, memory, **fe_sections),
            "--save", fe_save], nproc=2)
    yaml_path = memory_yaml(tmp_path, layers=memory["layers"])
    proc = launch(["fe_megatron.megatron_lm.pretrain_gpt", *megatron_lm_arguments(small_data, lm_save, yaml_path),
                   *lm_extra], nproc=2)
    worst = assert_same_curve(losses(lm_save), losses(fe_save))
    print(f"{layout}: largest per-step lm loss difference against fe-pretrain {worst:.2e}")
    assert "sparsity loss:" in proc.stdout
    in_stores = layout != "tp2"
    assert ("in stores" in proc.stdout) == in_stores and ("as the engine's parameters" in proc.stdout) != in_stores
    if layout == "dp2-node-host-bf16":
        assert f"in shared host memory ({tmp_path}), one copy per node" in proc.stdout
    if layout == "dp2-rows-rowwise-adagrad":  # the table member's rows and row-wise state resume, and convert
        resumed = str(tmp_path / "resumed")
        shutil.copytree(os.path.join(lm_save, "iter_0000006"), os.path.join(resumed, "iter_0000006"))
        with open(os.path.join(resumed, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write("6")
        launch(["fe_megatron.megatron_lm.pretrain_gpt", *megatron_lm_arguments(small_data, resumed, yaml_path),
                *lm_extra, "--load", resumed], nproc=2)
        after, uninterrupted = losses(resumed), losses(lm_save)
        assert sorted(after) == list(range(7, STEPS + 1)), sorted(after)
        assert all(after[step] == uninterrupted[step] for step in after), (after, uninterrupted)
        check_conversion(resumed, tmp_path)


def check_conversion(save: str, tmp_path):
    """fe-convert mcore-to-hf of the run's last checkpoint: the Hugging Face model's logits equal the
    Megatron model's (loaded in one process)."""
    from transformers import AutoModelForCausalLM

    from fe_megatron.convert.to_hf import mcore_to_hf
    from tests.helpers.torchrun_util import megatron_logits

    hf_dir = mcore_to_hf(save, str(tmp_path / "hf"))
    tokens = torch.randint(0, 512, (2, 48))
    expected = megatron_logits(save, tokens, 1, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        got = model(tokens).logits
    assert (got - expected).abs().max() < 1e-5, (got - expected).abs().max()


@needs_trainer
def test_one_process_matches_fe_pretrain_resumes_exactly_and_converts(small_data, tmp_path):
    fe_save, lm_save, resumed = str(tmp_path / "fe"), str(tmp_path / "lm"), str(tmp_path / "resumed")
    launch(["fe_megatron.train", "--config", fe_pretrain_config(small_data, tmp_path), "--save", fe_save], nproc=1)
    arguments = megatron_lm_arguments(small_data, lm_save, memory_yaml(tmp_path))
    launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments], nproc=1)
    assert_same_curve(losses(lm_save), losses(fe_save))

    # --load from the step-6 checkpoint ends on the uninterrupted curve
    shutil.copytree(os.path.join(lm_save, "iter_0000006"), os.path.join(resumed, "iter_0000006"))
    with open(os.path.join(resumed, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("6")
    arguments = megatron_lm_arguments(small_data, resumed, memory_yaml(tmp_path)) + ["--load", resumed]
    launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments], nproc=1)
    after = {step: value for step, value in losses(resumed).items()}
    assert sorted(after) == list(range(7, STEPS + 1)), sorted(after)
    assert all(after[step] == losses(lm_save)[step] for step in after), (after, losses(lm_save))

    check_conversion(resumed, tmp_path)  # fe-convert mcore-to-hf: the Hugging Face logits equal the Megatron ones


@needs_trainer
def test_without_factorengram_arguments_it_trains_the_stock_gpt_model(small_data, tmp_path):
    from fe_megatron.convert.megatron_reader import DistCheckpoint

    stock, with_memory = str(tmp_path / "stock"), str(tmp_path / "memory")
    short = ["--train-iters", "2", "--save-interval", "2", "--eval-iters", "0", "--lr-warmup-iters", "0"]
    arguments = megatron_lm_arguments(small_data, stock) + short
    launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments], nproc=1)
    arguments = megatron_lm_arguments(small_data, with_memory, memory_yaml(tmp_path)) + short
    launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments], nproc=1)
    stock_keys = set(DistCheckpoint(os.path.join(stock, "iter_0000002")).weight_names())
    memory_keys = set(DistCheckpoint(os.path.join(with_memory, "iter_0000002")).weight_names())
    # a stock GPT checkpoint stacks its alike layers under decoder.layers.<name>; the memory model's
    # layers differ, so they are stored one by one, decoder.layers.<i>.<name>
    assert stock_keys and not any(".memory." in key for key in stock_keys)
    assert not any(re.match(r"decoder\.layers\.\d", key) for key in stock_keys)
    backbone_keys = {re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", key) for key in memory_keys
                     if ".memory." not in key}
    assert stock_keys == backbone_keys, stock_keys ^ backbone_keys
    assert {key for key in memory_keys if ".memory." in key}


@needs_trainer
def test_arguments_the_memory_branch_cannot_honor_are_refused_by_name(small_data, tmp_path):
    arguments = megatron_lm_arguments(small_data, str(tmp_path / "run"), memory_yaml(tmp_path, table_dtype="fp8"))
    proc = launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments, "--context-parallel-size", "2",
                   "--fe-table-sharding", "rows"], nproc=2, expect_ok=False)
    assert proc.returncode != 0
    assert "  - --fe-table-sharding rows with --context-parallel-size > 1" in proc.stderr, proc.stderr[-3000:]
    assert "  - table_dtype=fp8: fp8 tables are for serving" in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists(os.path.join(tmp_path, "run", "iter_0000001"))


@needs_trainer
def test_what_tables_in_stores_cannot_run_beside_is_refused_by_name(small_data, tmp_path):
    arguments = megatron_lm_arguments(small_data, str(tmp_path / "run"), memory_yaml(tmp_path))
    proc = launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments, "--fe-table-sharding", "rows",
                   "--ckpt-format", "torch", "--data-parallel-random-init"], nproc=2, expect_ok=False)
    assert proc.returncode != 0
    assert "  - --ckpt-format torch: the tables in stores" in proc.stderr, proc.stderr[-3000:]
    assert "  - --data-parallel-random-init" in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists(os.path.join(tmp_path, "run", "iter_0000001"))


@needs_trainer
def test_resuming_tables_trained_the_other_way_with_the_distributed_optimizer_is_refused(small_data, tmp_path):
    """Tables saved as the trainer's parameters keep their moments in the distributed optimizer's flat
    buffers, which the table optimizer of a run with tables in stores cannot read: refused by name."""
    save = str(tmp_path / "run")
    short = ["--train-iters", "2", "--save-interval", "2", "--eval-iters", "0", "--lr-warmup-iters", "0",
             "--use-distributed-optimizer"]
    arguments = megatron_lm_arguments(small_data, save, memory_yaml(tmp_path)) + short
    launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments], nproc=1)
    with open(os.path.join(save, "iter_0000002", "fe_run.json")) as fh:
        assert json.load(fh)["tables"] == "parameters"
    proc = launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments, "--load", save, "--fe-table-update",
                   "rowwise_adagrad"], nproc=1, expect_ok=False)
    assert proc.returncode != 0
    assert "trained its tables as Megatron's parameters" in proc.stderr, proc.stderr[-3000:]


# Megatron-LM's trainer in this one process (no torchrun), then what it patched, during its run and after it
IN_ONE_PROCESS = textwrap.dedent("""
    import json, os, socket, sys, warnings
    warnings.filterwarnings("ignore")
    from tests.helpers.patched import changed, snapshot

    before = snapshot()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from fe_megatron.megatron_lm import pretrain_gpt, run

    during, pretrain = {}, run._pretrain

    def pretrain_seen(*args, **kwargs):  # megatron.training's pretrain, once everything is installed
        during.update(snapshot())
        return pretrain(*args, **kwargs)

    run._pretrain = pretrain_seen
    assert pretrain_gpt.main(json.loads(sys.argv[1])) == 0
    print("installed during the run:", len(changed(before, during)))
    print("changed:", changed(before, snapshot()))
""")


@needs_trainer
def test_a_trainer_run_leaves_torch_and_megatron_as_they_were(small_data, tmp_path):
    """Two steps of Megatron-LM's trainer with memory, in one process: what it patched (its hooks, the CPU
    backend, the tables' gradients into ``main_grad``: tests/helpers/patched.py) is the original again after."""
    arguments = megatron_lm_arguments(small_data, str(tmp_path / "run"), memory_yaml(tmp_path))
    save = arguments.index("--save")
    del arguments[save:save + 4]  # --save and --save-interval: nothing to write
    arguments += ["--train-iters", "2", "--eval-iters", "0", "--lr-warmup-iters", "0"]
    proc = run_in_own_session([sys.executable, "-c", IN_ONE_PROCESS, json.dumps(arguments)], clean_environment())
    assert proc.returncode == 0, failed_launch(proc, stderr_tail=5000)
    lines = proc.stdout.strip().splitlines()
    assert int(lines[-2].split(": ")[1]) > 0, lines[-2:]  # the run did patch
    assert lines[-1] == "changed: []", lines[-1]


@pytest.mark.skipif(compat.has_megatron_lm_trainer(), reason="this megatron-core has the Megatron-LM trainer")
def test_without_the_trainer_the_entry_point_names_the_release_it_needs():
    proc = subprocess.run([sys.executable, "-m", "fe_megatron.megatron_lm.pretrain_gpt", "--num-layers", "2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"megatron-core>={compat.TRAINER_MINIMUM}" in proc.stderr
    assert compat.megatron_core_version() in proc.stderr


EXAMPLES = os.path.join(ROOT, "examples", "megatron_lm")
CPU_DEVICE_ARGS = ("--distributed-backend gloo --transformer-impl local --use-cpu-initialization "
                   "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion "
                   "--no-bias-swiglu-fusion --no-rope-fusion")


def test_example_scripts_differ_in_the_launch_line_only():
    """The documented change: pretrain_gpt_factorengram.sh is pretrain_gpt.sh with the launch line (and
    the memory arguments' default) changed; every script parses."""
    with open(os.path.join(EXAMPLES, "pretrain_gpt.sh")) as fh:
        stock = fh.read().splitlines()
    with open(os.path.join(EXAMPLES, "pretrain_gpt_factorengram.sh")) as fh:
        factorengram = fh.read().splitlines()
    changed = [line for line in factorengram if line not in stock and not line.startswith("#")]
    assert changed == ['FE_MEMORY_ARGS=${FE_MEMORY_ARGS:---fe-memory-preset factorengram-340m}',
                       'torchrun --nproc-per-node "$NPROC" -m fe_megatron.megatron_lm.pretrain_gpt $FE_MEMORY_ARGS \\'
                       ], changed
    for name in ("pretrain_gpt.sh", "pretrain_gpt_factorengram.sh", "pretrain_gpt_factorengram.sbatch"):
        assert subprocess.run(["bash", "-n", os.path.join(EXAMPLES, name)]).returncode == 0, name


@needs_trainer
def test_the_documented_example_script_trains(small_data, tmp_path):
    save = str(tmp_path / "run")
    env = clean_environment(NPROC="1", DATA_PATH=small_data["prefix"], TOKENIZER_MODEL=small_data["tokenizer"],
                            SAVE=save, DEVICE_ARGS=CPU_DEVICE_ARGS,
                            FE_MEMORY_ARGS=f"--fe-memory-config {memory_yaml(tmp_path)}",
                            PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    small = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
             "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "3", "--lr-warmup-iters", "1", "--save-interval", "3",
             "--eval-iters", "0", "--split", "90,5,5"]
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, "pretrain_gpt_factorengram.sh"), *small], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, failed_launch(proc)
    assert sorted(losses(save)) == [1, 2, 3]
    with open(os.path.join(save, "iter_0000003", "fe_run.json")) as fh:
        assert json.load(fh)["config"]["memory"]["layers"] == MEMORY["layers"]
