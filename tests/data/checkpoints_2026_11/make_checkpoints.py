"""Writes the checkpoints in this folder: one small fe-pretrain run per engine and table mode.

Each run trains 4 steps from scratch with checkpoints at steps 2 and 4.  The folder keeps
checkpoint 2, as the run's own tracker names it, and ``expected.json`` keeps the values that
run logged at steps 3 and 4.  `tests/integration/test_table_checkpoints.py` resumes every
checkpoint with today's code and checks those values.

    python tests/data/checkpoints_2026_11/make_checkpoints.py [MODE ...]   # from the repository root

The training data is made from the bundled corpus with ``tokenizer.model`` (kept here: the
resume guard checks the tokenizer's sha256), exactly as the test makes it.  The runs work in a
fresh temporary folder holding a copy of the tokenizer, so the paths the checkpoints record
(``fe_run.json`` keeps the tokenizer's absolute path) name nothing but that folder.
``tokenizer.model`` itself was made with ``fe-data train-tokenizer --vocab-size 512`` from the
same 40 addresses.
"""

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)  # run as a script: the tests' launch helpers
CONFIG = os.path.join("examples", "configs", "demo_cpu.yaml")  # paths relative to the repository root
CORPUS = os.path.join(ROOT, "data", "sotu.jsonl.gz")
TOKENIZER = os.path.join(HERE, "tokenizer.model")
SAVED_STEP, LAST_STEP = 2, 4

# a 2-layer, d=16 FactorEngram with memory at both layers: about 50K parameters, 25K of them in tables
TINY = {"model.vocab_size": 512, "model.hidden_size": 16, "model.num_layers": 2, "model.num_attention_heads": 2,
        "model.ffn_hidden_size": 32, "model.seq_length": 32, "memory.layers": "[0, 1]",
        "memory.table_capacity": "[512, 521, 521]", "memory.coeff_width": 24, "memory.memory_dim": 16,
        "training.train_steps": LAST_STEP, "training.save_interval": SAVED_STEP, "training.log_interval": 1,
        "training.eval_interval": SAVED_STEP, "training.eval_steps": 1, "training.micro_batch_size": 2,
        "training.global_batch_size": 4, "optimizer.warmup_steps": 1, "optimizer.table_lr_mult": 2.0}

# engine and table mode: (processes, overrides)
MODES = {
    "megatron_replicated": (1, {}),
    "megatron_rows": (2, {"parallel.table_sharding": "rows"}),
    "megatron_bf16_stores": (1, {"memory.table_dtype": "bf16"}),
    "megatron_host_tier": (1, {"memory.table_placement": "host"}),
    "megatron_rowwise_adagrad": (2, {"parallel.table_sharding": "rows", "optimizer.table_update": "rowwise_adagrad"}),
    "deepspeed_zero3": (2, {"training.engine": "deepspeed", "parallel.table_sharding": "zero",
                            "deepspeed": "{zero_optimization: {stage: 3}}"}),
    "deepspeed_rows": (2, {"training.engine": "deepspeed", "parallel.table_sharding": "rows",
                           "optimizer.clip_grad": 0.0, "deepspeed": "{zero_optimization: {stage: 3}}"}),
}


def make_data(out: str, tokenizer: str = TOKENIZER) -> str:
    """The first 40 bundled addresses as an indexed dataset tokenized with ``tokenizer.model``."""
    from fe_megatron.data.cli import main as fe_data

    subset = os.path.join(out, "subset.jsonl")
    with gzip.open(CORPUS, "rt") as src, open(subset, "w") as dst:
        for i, line in enumerate(src):
            if i >= 40:
                break
            dst.write(line)
    assert fe_data(["preprocess", "--input", subset, "--tokenizer-model", tokenizer, "--output-prefix",
                    os.path.join(out, "corpus"), "--no-progress"]) == 0
    return os.path.join(out, "corpus")


def overrides(mode: str, data_prefix: str, tokenizer: str = TOKENIZER) -> list:
    values = dict(TINY, **{"data.tokenizer_model": tokenizer, "data.train_data": f"[{data_prefix}]"})
    values.update(MODES[mode][1])
    return [f"{key}={value}" for key, value in values.items()]


def logged_steps(save: str, steps) -> dict:
    """{step: {lm_loss, sparsity_loss, val_loss (where logged)}} from a run's metrics.jsonl (last record wins)."""
    values = {}
    with open(os.path.join(save, "metrics.jsonl")) as fh:
        for line in fh:
            record = json.loads(line)
            if record.get("step") in steps and "event" not in record:
                values.setdefault(str(record["step"]), {}).update(
                    {k: record[k] for k in ("lm_loss", "sparsity_loss", "val_loss") if k in record})
    return values


def main(modes=None) -> None:
    """Write every mode of ``modes`` (default: all of them) and its expected values, keeping the
    other modes' folders and values."""
    from fe_megatron.checkpoint.files import write_tracker
    from fe_megatron.deepspeed.engine import write_deepspeed_latest

    from tests.helpers.torchrun_util import clean_environment
    from tests.helpers.training import pretrain_cmd

    with open(os.path.join(HERE, "expected.json")) as fh:
        expected = {mode: values for mode, values in json.load(fh)["modes"].items() if mode in MODES}
    env = clean_environment()
    work = tempfile.mkdtemp(prefix="fe_megatron_checkpoints_")
    tokenizer = shutil.copy(TOKENIZER, work)
    data = make_data(work, tokenizer)
    for mode, (nproc, _) in MODES.items():
        if modes and mode not in modes:
            continue
        save = os.path.join(work, mode)
        # through ends_cleanly.py: a process group left to Python's exit fails the mode by name
        subprocess.run(pretrain_cmd(nproc, ends_cleanly=True) + ["--config", CONFIG, "--save", save]
                       + overrides(mode, data, tokenizer), check=True, env=env, cwd=ROOT)
        target = os.path.join(HERE, mode)
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
        saved = os.path.join(target, f"iter_{SAVED_STEP:07d}")
        shutil.copytree(os.path.join(save, f"iter_{SAVED_STEP:07d}"), saved)
        if os.path.exists(os.path.join(save, "latest")):  # DeepSpeed's own pointer
            write_deepspeed_latest(target, saved)
        write_tracker(target, SAVED_STEP)
        expected[mode] = {"processes": nproc, "overrides": {k: str(v) for k, v in MODES[mode][1].items()},
                          "steps": logged_steps(save, range(SAVED_STEP + 1, LAST_STEP + 1))}
    with open(os.path.join(HERE, "expected.json"), "w") as fh:
        json.dump({"tiny": {k: str(v) for k, v in TINY.items()},
                   "modes": {mode: expected[mode] for mode in MODES if mode in expected}}, fh, indent=1)
    shutil.rmtree(work)


if __name__ == "__main__":
    main(sys.argv[1:])
