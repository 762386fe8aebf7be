"""Megatron-LM's own example recipes, changed only in size, train with FactorEngram by adding `--fe-*` flags.

examples/megatron_lm/recipes/ carries the arguments and values of Megatron-LM's Llama-3 8B, GPT-3 175B
and Mixtral 8x7B scripts; on a CPU the scripts shrink the sizes and swap the device flags (each marked
"CPU:" there). Each recipe trains 6 steps (Mixtral's at EP=2 over 2 processes, the others at one) on the
whole bundled corpus, resumes from its step-3 checkpoint, and converts to Hugging Face where the backbone
has a Hugging Face form.
Runs on the newest stack (megatron.training ships from megatron-core 0.19 on).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from fe_megatron.megatron import compat
from tests.helpers.megatron_lm import losses
from tests.helpers.paths import CORPUS, ROOT
from tests.helpers.torchrun_util import clean_environment, failed_launch

RECIPES = os.path.join(ROOT, "examples", "megatron_lm", "recipes")
pytestmark = pytest.mark.skipif(not compat.has_megatron_lm_trainer(), reason=(
    f"megatron-core {compat.megatron_core_version()} has no Megatron-LM trainer (megatron.training, "
    f"{compat.TRAINER_MINIMUM} on); `make test-newest` runs these tests"))


def tokenized_corpus(out, vocab_size: int) -> dict:
    """The whole bundled corpus in ``out``: a ``vocab_size``-piece tokenizer trained on it (``tokenizer``)
    and the indexed dataset it makes (``prefix``)."""
    import gzip

    from fe_megatron.data.cli import main as fe_data

    text = out / "sotu.jsonl"
    with gzip.open(CORPUS, "rt") as src, open(text, "w") as dst:
        shutil.copyfileobj(src, dst)
    assert fe_data(["train-tokenizer", "--input", str(text), "--output-prefix", str(out / "tok"),
                    "--vocab-size", str(vocab_size)]) == 0
    assert fe_data(["preprocess", "--input", str(text), "--tokenizer-model", str(out / "tok.model"),
                    "--output-prefix", str(out / "sotu"), "--no-progress"]) == 0
    return dict(tokenizer=str(out / "tok.model"), prefix=str(out / "sotu"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The whole bundled corpus (233 documents; the recipes' splits need more than small_data's 40) with a
    512-piece tokenizer."""
    return tokenized_corpus(tmp_path_factory.mktemp("corpus"), 512)


def recipe(name: str, corpus: dict, save: str, *extra, expect_ok: bool = True, **env) -> subprocess.CompletedProcess:
    """``bash examples/megatron_lm/recipes/NAME.sh EXTRA`` at the CPU size."""
    environment = clean_environment(DATA_PATH=corpus["prefix"], TOKENIZER_MODEL=corpus["tokenizer"], SAVE=save,
                                    PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
                                    **env)
    proc = subprocess.run(["bash", os.path.join(RECIPES, f"{name}.sh"), *extra], env=environment, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    if expect_ok:
        assert proc.returncode == 0, failed_launch(proc, stderr_tail=5000)
    return proc


def resumed_from_step_3(save: str, tmp_path) -> str:
    """A run directory holding only ``save``'s step-3 checkpoint (the recipes --load their --save)."""
    resumed = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(save, "iter_0000003"), os.path.join(resumed, "iter_0000003"))
    with open(os.path.join(resumed, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("3")
    return resumed


def test_llama3_recipe_trains_resumes_exactly_and_converts(corpus, tmp_path):
    """Llama-3 8B's recipe: --decoupled-lr, --calculate-per-token-loss, the distributed optimizer with
    overlapped reduce and gather, GQA, untied embeddings, rope base 1e6, --sequence-parallel (inactive at
    TP=1). With whole tables as the trainer's parameters at one process, and with node-shared host tables in
    stores at DP=2 (each node's row shards once in shared memory, beside the decoupled learning rate's groups),
    the curves agree; --load of the node-shared run's step 3 ends on its uninterrupted curve exactly, leaving no
    segment behind; the resumed checkpoint converts with equal logits."""
    from fe_megatron.tables.node_shared import PREFIX
    from tests.helpers.torchrun_util import megatron_logits

    save = str(tmp_path / "llama")
    proc = recipe("llama3_8b", corpus, save)
    curve = losses(save)
    assert sorted(curve) == [1, 2, 3, 4, 5, 6], curve
    assert "its checkpoints will convert to Hugging Face" in proc.stdout
    print("llama3_8b: lm loss at step 1 %.4f, at step 6 %.4f" % (curve[1][0], curve[6][0]))

    segments = tmp_path / "shm"
    segments.mkdir()
    node_shared = dict(NPROC="2", FE_ARGS="--fe-memory-preset factorengram-tiny --fe-memory-layers 1 3 --fe-table-"
                       f"sharding node --fe-table-placement host --fe-shared-table-folder {segments}")
    stores = str(tmp_path / "stores")
    proc = recipe("llama3_8b", corpus, stores, **node_shared)
    assert "in stores" in proc.stdout and "one copy per node" in proc.stdout, proc.stdout[-3000:]
    in_stores = losses(stores)
    assert sorted(in_stores) == [1, 2, 3, 4, 5, 6]
    assert max(abs(in_stores[step][0] - curve[step][0]) for step in in_stores) < 1e-5, (in_stores, curve)

    resumed = resumed_from_step_3(stores, tmp_path)
    recipe("llama3_8b", corpus, resumed, **node_shared)
    after = losses(resumed)
    assert sorted(after) == [4, 5, 6] and all(after[step] == in_stores[step] for step in after), (after, in_stores)
    assert not [name for name in os.listdir(segments) if name.startswith(PREFIX)]

    from transformers import AutoModelForCausalLM

    from fe_megatron.convert.to_hf import mcore_to_hf

    hf_dir = mcore_to_hf(resumed, str(tmp_path / "hf"))
    tokens = torch.randint(0, 512, (2, 48))
    expected = megatron_logits(resumed, tokens, 1, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
    with torch.no_grad():
        assert (model(tokens).logits - expected).abs().max() < 1e-5


def test_llama3_recipe_with_sequence_parallel_at_tp2(corpus, tmp_path):
    """--sequence-parallel at TP=2 without Transformer Engine or Apex: the project's norm takes it where
    megatron-core's torch norm refuses it; the curve follows TP=1's."""
    reference, save = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    recipe("llama3_8b", corpus, reference, TRAIN_ITERS="2", SAVE_INTERVAL="2")
    proc = recipe("llama3_8b", corpus, save, NPROC="2", TP="2", TRAIN_ITERS="2", SAVE_INTERVAL="2")
    assert "sequence_parallel ............................... True" in proc.stdout
    got, expected = losses(save), losses(reference)
    assert max(abs(got[step][0] - expected[step][0]) for step in (1, 2)) < 1e-4, (got, expected)


def test_gpt3_recipe_refuses_its_split_on_a_small_corpus_then_trains_and_says_it_will_not_convert(corpus, tmp_path):
    """GPT-3 175B's recipe (fp16 -> fp32; --step-batch-size-schedule left out, which megatron-core 0.19.2
    refuses beside --global-batch-size). Its --split 949,50,1 leaves the 233-document corpus' test part
    without a document: refused by name at once (megatron.core would loop forever), as the log's last
    lines. With 949,50,10 it trains and resumes onto the uninterrupted curve exactly, with the recipe's dropout
    of 0.1 (on the host the CPU generator stands in for the device's, and the data loaders draw from their
    own); its LayerNorm/GELU/learned-position backbone has no Hugging Face form, which the run says at start-up."""
    save = str(tmp_path / "gpt3")
    proc = recipe("gpt3_175b", corpus, save, expect_ok=False, SPLIT="949,50,1")
    assert proc.returncode != 0
    assert "--split 949,50,1: the test split" in proc.stderr, proc.stderr[-3000:]
    tail = proc.stderr.strip().splitlines()[-4:]
    assert any("--split 949,50,1: the test split" in line for line in tail), tail
    assert not os.path.exists(os.path.join(save, "metrics.jsonl"))  # nothing trained

    proc = recipe("gpt3_175b", corpus, save)
    curve = losses(save)
    assert sorted(curve) == [1, 2, 3, 4, 5, 6]
    assert "will not convert to Hugging Face" in proc.stdout and "--swiglu" in proc.stdout
    print("gpt3_175b: lm loss at step 1 %.4f, at step 6 %.4f" % (curve[1][0], curve[6][0]))
    resumed = resumed_from_step_3(save, tmp_path)
    recipe("gpt3_175b", corpus, resumed)
    after = losses(resumed)
    assert sorted(after) == [4, 5, 6] and all(after[step] == curve[step] for step in after), (after, curve)

    from fe_megatron.convert.common import ConversionError
    from fe_megatron.convert.to_hf import mcore_to_hf

    with pytest.raises(ConversionError, match="would need --swiglu"):
        mcore_to_hf(save, str(tmp_path / "hf"))


def test_mixtral_recipe_trains_an_moe_backbone_with_memory_and_resumes(corpus, tmp_path):
    """Mixtral 8x7B's recipe: 8 experts, top-2, aux-loss balancing, the distributed optimizer, its own
    all-to-all token dispatcher; at EP=2 over 2 processes (its PP=4 x EP=8 needs 32 ranks) beside row-sharded
    tables. Its curve equals the allgather dispatcher's within 1e-5. It resumes from step 3 (the recipe loads
    neither optimizer nor random state, so only the steps are checked), and says at start-up that an MoE
    checkpoint will not convert."""
    layout = dict(EP="2", NPROC="2", FE_ARGS="--fe-memory-preset factorengram-tiny --fe-memory-layers 1 3 "
                                            "--fe-table-sharding rows")
    save = str(tmp_path / "mixtral")
    proc = recipe("mixtral_8x7b", corpus, save, **layout)
    curve = losses(save)
    assert sorted(curve) == [1, 2, 3, 4, 5, 6]
    assert "will not convert to Hugging Face" in proc.stdout and "--num-experts" in proc.stdout
    print("mixtral_8x7b: lm loss at step 1 %.4f, at step 6 %.4f" % (curve[1][0], curve[6][0]))
    allgather = str(tmp_path / "allgather")
    recipe("mixtral_8x7b", corpus, allgather, "--moe-token-dispatcher-type", "allgather", **layout)
    other = losses(allgather)
    assert sorted(other) == sorted(curve) and max(abs(other[step][0] - curve[step][0]) for step in curve) < 1e-5, \
        (curve, other)
    resumed = resumed_from_step_3(save, tmp_path)
    recipe("mixtral_8x7b", corpus, resumed, **layout)
    assert sorted(losses(resumed)) == [4, 5, 6]


def test_every_argument_the_machine_cannot_honor_is_refused_in_one_message(corpus, tmp_path):
    """A recipe's GPU flags on a CPU machine (no --transformer-impl local, nccl, fused kernels, the CUDA
    profiler, the zero-centered norm) and a mistyped --fe-* flag: each refused by name with what to use
    instead, all in one message, before Megatron-LM's argument dump, and at the end of the log."""
    arguments = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                 "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "2",
                 "--train-iters", "2", "--lr", "1e-4", "--tokenizer-type", "SentencePieceTokenizer",
                 "--tokenizer-model", corpus["tokenizer"], "--data-path", corpus["prefix"], "--split", "90,5,5",
                 "--fe-memory-preset", "factorengram-tiny", "--profile", "--apply-layernorm-1p"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
           "fe_megatron.megatron_lm.pretrain_gpt"]
    proc = subprocess.run(cmd + arguments + ["--fe-memroy-layers", "1"], env=clean_environment(), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--fe-memroy-layers: unknown argument; did you mean --fe-memory-layers?" in proc.stderr, proc.stderr[-3000:]

    proc = subprocess.run(cmd + arguments, env=clean_environment(), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    for fragment in ("--transformer-impl transformer_engine (the default)", "--distributed-backend nccl",
                     "--profile:", "--apply-layernorm-1p:", "gradient-accumulation-fusion (on by default)",
                     "weights initialized on the GPU"):
        assert f"  - {fragment}" in proc.stderr, (fragment, proc.stderr[-4000:])
    assert " arguments ---" not in proc.stdout  # the argument dump comes only after the check passed
    assert "cannot run here as given" in "\n".join(proc.stderr.strip().splitlines()[-12:])


def test_help_lists_the_factorengram_arguments():
    """megatron-core 0.19.2's parser fails on --help (a help string with a bare %); the drop-in repairs it."""
    proc = subprocess.run([sys.executable, "-m", "fe_megatron.megatron_lm.pretrain_gpt", "--help"],
                          env=clean_environment(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--fe-memory-preset" in proc.stdout and "factorengram-340m" in proc.stdout
    assert "1.10 = 10%)" in proc.stdout.replace("\n", " ").replace("  ", " ") or "--moe-paged-stash" in proc.stdout


def test_data_made_with_another_tokenizer_is_refused_before_training(corpus, tmp_path):
    """--data-path made with a 1024-piece tokenizer, --tokenizer-model the 512-piece one: refused by naming
    both files before any step (before, the first forward failed on a token id), and no metrics are left."""
    (tmp_path / "large").mkdir()
    large = tokenized_corpus(tmp_path / "large", 1024)
    save = str(tmp_path / "run")
    proc = recipe("llama3_8b", {**corpus, "prefix": large["prefix"]}, save, expect_ok=False)
    assert proc.returncode != 0
    assert f"{large['prefix']}.bin holds token id" in proc.stderr, proc.stderr[-3000:]
    assert f"{corpus['tokenizer']} has 512 pieces" in proc.stderr and "--tokenizer-model" in proc.stderr
    assert not os.path.exists(os.path.join(save, "metrics.jsonl"))


def documented_change() -> str:
    """The diff docs/megatron_lm.md gives under "A training script of your own"."""
    with open(os.path.join(ROOT, "docs", "megatron_lm.md")) as fh:
        text = fh.read()
    section = text[text.index("## A training script of your own"):]
    return section[section.index("```diff\n") + len("```diff\n"):section.index("```", section.index("```diff\n") + 7)]


def test_a_script_in_the_shape_of_pretrain_gpt_trains_with_the_documented_change_and_converts(small_data, tmp_path):
    """tests/data/pretrain_gpt_shaped.py (its own batch, loss and forward step) with the documented diff
    applied trains the drop-in's curve; its checkpoint converts, and converts too once its fe_run.json and
    manifest are gone (the run info rebuilt from the arguments Megatron-LM stored)."""
    from tests.helpers.megatron_lm import STEPS, launch, megatron_lm_arguments, memory_yaml

    script = tmp_path / "pretrain_gpt.py"
    shutil.copy(os.path.join(ROOT, "tests", "data", "pretrain_gpt_shaped.py"), script)
    (tmp_path / "change.diff").write_text(documented_change())
    applied = subprocess.run(["patch", "-p0", "-i", "change.diff"], cwd=tmp_path, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "with_factorengram(args, forward_step)" in script.read_text()

    own, drop_in = str(tmp_path / "own"), str(tmp_path / "drop_in")
    arguments = megatron_lm_arguments(small_data, own, memory_yaml(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script),
           *arguments]
    proc = subprocess.run(cmd, env=clean_environment(PYTHONPATH=ROOT), cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, failed_launch(proc, stderr_tail=5000)
    launch(["fe_megatron.megatron_lm.pretrain_gpt", *megatron_lm_arguments(small_data, drop_in,
                                                                           memory_yaml(tmp_path))], nproc=1)
    got, expected = losses(own), losses(drop_in)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    assert max(abs(got[step][0] - expected[step][0]) for step in got) < 1e-5, (got, expected)

    from fe_megatron.convert.to_hf import mcore_to_hf

    sealed = mcore_to_hf(own, str(tmp_path / "hf_sealed"))
    bare = str(tmp_path / "bare")
    shutil.copytree(os.path.join(own, f"iter_{STEPS:07d}"), os.path.join(bare, f"iter_{STEPS:07d}"))
    with open(os.path.join(bare, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(STEPS))
    for name in ("fe_run.json", "fe_manifest.json"):
        os.remove(os.path.join(bare, f"iter_{STEPS:07d}", name))
    rebuilt = mcore_to_hf(bare, str(tmp_path / "hf_bare"))
    from safetensors.torch import load_file

    def weights(directory):
        out = {}
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(directory, name)))
        return out

    one, other = weights(sealed), weights(rebuilt)
    assert one.keys() == other.keys() and all(torch.equal(one[key], other[key]) for key in one)
    with open(os.path.join(sealed, "config.json")) as fh, open(os.path.join(rebuilt, "config.json")) as gh:
        assert json.load(fh) == json.load(gh)


def printed_lm_losses(stdout: str, entry: str = "lm loss") -> list:
    """The ``lm loss`` (or another ``entry``: ``sparsity loss``, ``grad norm``) Megatron-LM's trainer prints at
    each iteration (a run without --save writes no metrics)."""
    return [float(match) for match in re.findall(rf"iteration +\d+/ *\d+ \|.*?{entry}: ([0-9.E+-]+)", stdout)]


def test_megatron_fsdp_trains_on_the_host_as_ddp_does_and_with_memory_beside_it(small_data, tmp_path):
    """The CPU backend answers Megatron-FSDP's CUDA assumptions (its device, device meshes, streams) as it
    does DDP's. The drop-in leaves CUDA_DEVICE_MAX_CONNECTIONS unset for it (Megatron-FSDP refuses 1), and
    on gloo NCCL's pre-multiplied sum is refused by name until --no-gradient-reduce-div-fusion is given.

    With memory, the backbone is under Megatron-FSDP (--use-megatron-fsdp, optim_grads_params, DP=2) and
    the tables are in stores outside it, whole or row-sharded, trained by the table optimizer with one
    gradient norm over both: LM loss, sparsity loss and gradient norm equal DDP's with the distributed
    optimizer (the tables its parameters) within 1e-5 over 6 steps, so the backbone under FSDP trains as
    under DDP. The row-sharded run evaluates nothing (--eval-iters 0): its last parameter gathers are waited
    for before the groups end, so no gloo thread is left to Python's exit (ends_cleanly.py). (Its
    checkpoints: test_llama3_fsdp_recipe_trains_resumes_exactly_and_converts.)"""
    from tests.helpers.megatron_lm import launch, megatron_lm_arguments, memory_yaml

    def without_save(arguments):
        index = arguments.index("--save")
        return arguments[:index] + arguments[index + 2:]

    arguments = without_save(megatron_lm_arguments(small_data, "unused")) + [
        "--train-iters", "6", "--lr-warmup-iters", "1", "--use-distributed-optimizer",
        "--fe-memory-config", memory_yaml(tmp_path)]
    ddp = launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments], nproc=2)
    fsdp_args = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                 "--ckpt-format", "fsdp_dtensor"]
    proc = launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments, *fsdp_args], nproc=2, expect_ok=False)
    assert proc.returncode != 0 and "add --no-gradient-reduce-div-fusion" in proc.stderr, proc.stderr[-3000:]
    fsdp_args.append("--no-gradient-reduce-div-fusion")
    for sharding, evaluation in (("replicated", []), ("rows", ["--eval-iters", "0"])):
        fsdp = launch(["fe_megatron.megatron_lm.pretrain_gpt", *arguments, *fsdp_args,
                       "--fe-table-sharding", sharding, *evaluation], nproc=2)
        assert "a backbone under Megatron-FSDP" in fsdp.stdout + fsdp.stderr, fsdp.stderr[-3000:]
        for entry in ("lm loss", "sparsity loss", "grad norm"):
            got, expected = printed_lm_losses(fsdp.stdout, entry), printed_lm_losses(ddp.stdout, entry)
            assert len(got) == len(expected) == 6, (entry, got, expected)
            assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-5, (sharding, entry, got, expected)


def test_llama3_fsdp_recipe_trains_resumes_exactly_and_converts(corpus, tmp_path):
    """Megatron-LM's Llama-3 recipe under Megatron-FSDP (examples/megatron_fsdp/): the backbone sharded
    (optim_grads_params) at DP=2 with --calculate-per-token-loss and --decoupled-lr, the tables in stores
    beside it. Its fsdp_dtensor checkpoints hold the tables beside Megatron-FSDP's part (fe_tables/, by
    global row): --load of step 3 ends on the uninterrupted curve exactly. Row-sharded tables train the
    same 3 steps within 1e-5, and so does the recipe's DDP branch (USE_MEGATRON_FSDP=0: tables as the
    trainer's parameters, torch_dist; the first launch's --load of an empty folder leaves both alike); the
    step-3 checkpoints of both convert to Hugging Face models whose logits agree within 1e-4 (SwiGLU's
    halves joined, the row-sharded tables gathered)."""
    save = str(tmp_path / "fsdp")
    proc = recipe("llama3_8b_fsdp", corpus, save)
    curve = losses(save)
    assert sorted(curve) == [1, 2, 3, 4, 5, 6], curve
    assert "in stores because of a backbone under Megatron-FSDP" in proc.stdout, proc.stdout[-3000:]
    assert os.path.isfile(os.path.join(save, "iter_0000003", "fe_tables", "metadata.json"))
    print("llama3_8b_fsdp: lm loss at step 1 %.4f, at step 6 %.4f" % (curve[1][0], curve[6][0]))

    resumed = resumed_from_step_3(save, tmp_path)
    recipe("llama3_8b_fsdp", corpus, resumed)
    after = losses(resumed)
    assert sorted(after) == [4, 5, 6] and all(after[step] == curve[step] for step in after), (after, curve)

    rows, ddp = str(tmp_path / "rows"), str(tmp_path / "ddp")
    recipe("llama3_8b_fsdp", corpus, rows, "--exit-interval", "3",
           FE_ARGS="--fe-memory-preset factorengram-tiny --fe-memory-layers 1 3 --fe-table-sharding rows")
    recipe("llama3_8b_fsdp", corpus, ddp, "--exit-interval", "3", USE_MEGATRON_FSDP="0")
    for run in (rows, ddp):
        other = losses(run)
        assert sorted(other) == [1, 2, 3], other
        assert max(abs(a - b) for step in (1, 2, 3) for a, b in zip(other[step], curve[step])) < 1e-5, (run, other)

    from transformers import AutoModelForCausalLM

    from fe_megatron.convert.to_hf import mcore_to_hf

    tokens = torch.randint(0, 512, (2, 48))
    logits = []
    for run in (rows, ddp):
        hf_dir = mcore_to_hf(run, run + "_hf")
        model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert (logits[0] - logits[1]).abs().max() < 1e-4
