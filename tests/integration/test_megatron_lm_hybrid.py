"""Megatron-LM's ``pretrain_hybrid.py`` with FactorEngram (`fe_megatron.megatron_lm.pretrain_hybrid`):
megatron-core's HybridModel, the memory before the attention of chosen attention layers.

A pattern of ``*-`` pairs is the GPT layer structure. A GPT+memory checkpoint of `pretrain_gpt` resumes
as hybrid+memory (megatron-core's GPT checkpoint interop, with the memory's layers kept layer by layer):
at one process the next losses are the GPT run's within 1e-6; at PP=2 with memory on the second stage only
and under full recompute they follow it within 1e-5 (TP=2 and DP=2 with row-sharded tables too, run once
by hand; fe-pretrain's hybrid layouts test them); and the hybrid
checkpoint converts to the same Hugging Face model as the GPT one, and fe-eval and fe-inspect read it; so does
one trained under Megatron-FSDP, its tables beside it. What
the hybrid model cannot do with memory is refused at start-up, by name. Runs on the newest stack.
"""

import json
import os

import pytest
import torch

from fe_megatron.megatron import compat
from tests.helpers.megatron_lm import STEPS, launch, losses, megatron_lm_arguments, memory_yaml
from tests.helpers.training import resume_at

pytestmark = pytest.mark.skipif(not (compat.has_megatron_lm_trainer() and compat.has_hybrid_model()), reason=(
    f"megatron-core {compat.megatron_core_version()} has no Megatron-LM trainer with HybridModel "
    f"({compat.HYBRID_MINIMUM} on); `make test-newest` runs these tests"))

PATTERN = "*-*-*-*-"  # the four GPT layers of megatron_lm_arguments


def hybrid_arguments(data, save, memory, *extra):
    """`megatron_lm_arguments`' command line as pretrain_hybrid.py takes it: the pattern instead of
    --num-layers."""
    arguments = megatron_lm_arguments(data, save, memory)
    at = arguments.index("--num-layers")
    return arguments[:at] + arguments[at + 2:] + list(extra)


def hf_logits(save: str, out: str, tokens) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from fe_megatron.convert.to_hf import mcore_to_hf

    model = AutoModelForCausalLM.from_pretrained(mcore_to_hf(save, out), trust_remote_code=True).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def gpt_run(small_data, tmp_path_factory) -> tuple:
    """``(save, memory YAML, losses)`` of a pretrain_gpt run with memory on blocks 2 and 3 (both on the second of
    two pipeline stages), 12 steps with checkpoints at 6 and 12."""
    tmp_path = tmp_path_factory.mktemp("gpt")
    memory = memory_yaml(tmp_path, layers=[2, 3])
    save = str(tmp_path / "gpt")
    launch(["fe_megatron.megatron_lm.pretrain_gpt", *megatron_lm_arguments(small_data, save, memory)], nproc=1)
    return save, memory, losses(save)


def test_a_gpt_checkpoint_with_memory_resumes_as_the_hybrid_model_and_converts_alike(small_data, gpt_run, tmp_path):
    gpt, memory, curve = gpt_run
    hybrid = resume_at(gpt, 6, str(tmp_path / "hybrid"))
    launch(["fe_megatron.megatron_lm.pretrain_hybrid", *hybrid_arguments(
        small_data, hybrid, memory, "--hybrid-layer-pattern", PATTERN, "--load", hybrid)], nproc=1)
    after = losses(hybrid)
    assert sorted(after) == list(range(7, STEPS + 1)), sorted(after)
    # bit for bit at most steps (5e-7 apart at one step was seen)
    assert max(abs(after[step][i] - curve[step][i]) for step in after for i in (0, 1)) < 1e-6, (after, curve)

    # the hybrid run's step-12 checkpoint converts to the Hugging Face model the GPT run's does (the six steps
    # since the GPT checkpoint moved the logits apart by 3.6e-7)
    tokens = torch.randint(0, 512, (2, 48))
    difference = (hf_logits(hybrid, str(tmp_path / "hybrid_hf"), tokens) -
                  hf_logits(gpt, str(tmp_path / "gpt_hf"), tokens)).abs().max()
    assert difference < 1e-5, difference

    # fe-eval and fe-inspect read the hybrid run as they read the GPT one
    from fe_megatron.evaluation.cli import main as fe_eval
    from fe_megatron.evaluation.inspect import main as fe_inspect

    text = tmp_path / "eval.jsonl"
    text.write_text("\n".join(json.dumps({"text": " ".join(map(str, range(n, n + 300)))}) for n in range(3)))
    perplexity = {}
    for name, run in (("hybrid", hybrid), ("gpt", gpt)):
        assert fe_eval(["ppl", "--load", run, "--data", str(text)]) == 0
        with open(os.path.join(run, "eval", "ppl-eval.json")) as fh:
            perplexity[name] = json.load(fh)["results"][0]["token_ppl"]
    assert abs(perplexity["hybrid"] / perplexity["gpt"] - 1) < 1e-6, perplexity
    assert fe_inspect(["--load", hybrid, "--data", str(text), "--output", str(tmp_path / "inspect")]) == 0
    assert (tmp_path / "inspect" / "summary.json").is_file()


# TP=2 and DP=2 with row-sharded tables passed here too; they run in fe-pretrain's hybrid layouts
# (tests/integration/test_hybrid_train.py), which build the same model, to keep the newest-stack subset short
LAYOUTS = {
    # the memory by the pattern's layer numbers (4 and 6: blocks 2 and 3), on the second stage only
    "pp2-memory-on-stage-2": (2, ["--hybrid-layer-pattern", "*-*-|*-*-", "--pipeline-model-parallel-size", "2",
                                  "--fe-memory-layers", "4", "6"]),
    "full-recompute": (1, ["--hybrid-layer-pattern", PATTERN, "--recompute-granularity", "full",
                           "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_hybrid_model_resumed_in_other_layouts_follows_the_gpt_curve(small_data, gpt_run, tmp_path, layout):
    """The GPT run's step-6 checkpoint resumed as the hybrid model at PP=2 (memory on the second stage only, the
    stages that read data) and under full recompute: within 1e-5 of the GPT curve."""
    gpt, memory, curve = gpt_run
    nproc, extra = LAYOUTS[layout]
    save = resume_at(gpt, 6, str(tmp_path / layout))
    launch(["fe_megatron.megatron_lm.pretrain_hybrid", *hybrid_arguments(small_data, save, memory, *extra,
                                                                          "--load", save)], nproc=nproc)
    after = losses(save)
    assert sorted(after) == list(range(7, STEPS + 1)), sorted(after)
    assert max(abs(after[step][0] - curve[step][0]) for step in after) < 1e-5, (after, curve)
    assert max(abs(after[step][1] - curve[step][1]) for step in after) < 1e-6, (after, curve)


def test_a_hybrid_model_under_megatron_fsdp_converts_and_generates_as_under_ddp(small_data, tmp_path):
    """The hybrid model under Megatron-FSDP (DP=2, optim_grads_params, ``fsdp_dtensor``: the tables in stores beside
    it, in ``fe_tables/``) and the same 3 steps under DDP at one process (torch_dist): fe-convert reads both, and
    the two Hugging Face models give the same logits within 1e-5 and the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    from fe_megatron.convert.to_hf import mcore_to_hf

    memory = memory_yaml(tmp_path, layers=[2, 3])
    short = ["--hybrid-layer-pattern", PATTERN, "--train-iters", "3", "--save-interval", "3", "--eval-interval", "3"]
    fsdp, ddp = str(tmp_path / "fsdp"), str(tmp_path / "ddp")
    launch(["fe_megatron.megatron_lm.pretrain_hybrid", *hybrid_arguments(
        small_data, fsdp, memory, *short, "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
        "optim_grads_params", "--ckpt-format", "fsdp_dtensor", "--no-gradient-reduce-div-fusion",
        "--use-distributed-optimizer")], nproc=2)
    assert os.path.isdir(os.path.join(fsdp, "iter_0000003", "fe_tables"))
    launch(["fe_megatron.megatron_lm.pretrain_hybrid", *hybrid_arguments(small_data, ddp, memory, *short)], nproc=1)
    tokens = torch.randint(0, 512, (2, 48))
    logits, generated = [], []
    for run in (fsdp, ddp):
        model = AutoModelForCausalLM.from_pretrained(mcore_to_hf(run, run + "_hf"), trust_remote_code=True).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits)
            generated.append(model.generate(tokens[:1, :8], max_new_tokens=16, do_sample=False)[0].tolist())
    assert (logits[0] - logits[1]).abs().max() < 1e-5
    assert generated[0] == generated[1]


def test_an_moe_pattern_trains_at_ep2_beside_row_sharded_tables(small_data, tmp_path):
    """'E' layers (megatron-core's local MoE, 4 experts over EP=2) beside row-sharded tables: a pretrain_gpt MoE
    run's step-6 checkpoint resumed as the hybrid pattern '*E' x 4 follows the GPT curve within 1e-5."""
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
           "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"]
    memory = memory_yaml(tmp_path)
    gpt = str(tmp_path / "gpt")
    launch(["fe_megatron.megatron_lm.pretrain_gpt", *megatron_lm_arguments(small_data, gpt, memory), *moe], nproc=2)
    curve = losses(gpt)
    save = resume_at(gpt, 6, str(tmp_path / "hybrid"))
    launch(["fe_megatron.megatron_lm.pretrain_hybrid", *hybrid_arguments(
        small_data, save, memory, *moe, "--hybrid-layer-pattern", "*E" * 4, "--fe-table-sharding", "rows",
        "--load", save)], nproc=2)
    after = losses(save)
    assert sorted(after) == list(range(7, STEPS + 1)), sorted(after)
    assert max(abs(after[step][0] - curve[step][0]) for step in after) < 1e-5, (after, curve)


def test_what_the_hybrid_model_cannot_do_with_memory_is_refused_at_start_up(small_data, tmp_path):
    memory = memory_yaml(tmp_path)
    save = str(tmp_path / "run")
    proc = launch(["fe_megatron.megatron_lm.pretrain_hybrid", *hybrid_arguments(
        small_data, save, memory, "--hybrid-layer-pattern", "*-M*-", "--fe-memory-layers", "1", "3")],
        nproc=1, expect_ok=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    for problem in ("'M' layers (Mamba) are not in the local hybrid stack",
                    "--fe-memory-layers 1 3 with --hybrid-layer-pattern '*-M*-': layer 1 is '-' (MLP): the memory goes "
                    "before the attention of an attention layer. Its attention ('*') layers are [0, 3]"):
        assert problem in proc.stderr, (problem, proc.stderr[-3000:])
    # MLA (megatron-core refuses '*' beside it): no local layers, and no memory before it yet
    proc = launch(["fe_megatron.megatron_lm.pretrain_hybrid", *hybrid_arguments(
        small_data, save, memory, "--hybrid-layer-pattern", "+-+-", "--fe-memory-layers", "2")],
        nproc=1, expect_ok=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    for problem in ("'+' layers (MLA) are not in the local hybrid stack",
                    "layer 2 is '+' (MLA): memory before MLA attention is not supported yet"):
        assert problem in proc.stderr, (problem, proc.stderr[-3000:])

    proc = launch(["fe_megatron.megatron_lm.pretrain_hybrid", *hybrid_arguments(small_data, save, memory)], nproc=1,
                  expect_ok=False)
    assert proc.returncode != 0 and "  - --hybrid-layer-pattern is missing" in proc.stderr, proc.stderr[-3000:]
    proc = launch(["fe_megatron.megatron_lm.pretrain_gpt", *megatron_lm_arguments(small_data, save, memory),
                   "--hybrid-layer-pattern", PATTERN], nproc=1, expect_ok=False)
    assert proc.returncode != 0 and "  - --hybrid-layer-pattern: a hybrid model; train it with " \
        "fe_megatron.megatron_lm.pretrain_hybrid" in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists(os.path.join(save, "iter_0000001"))
