"""fe-eval against hand computations: a model whose every weight is zero predicts the uniform
distribution over its vocabulary V, so each token costs exactly log V."""

import json
import math
import os
import subprocess
import sys

import pytest

from fe_megatron.evaluation import tasks
from fe_megatron.evaluation.cli import main as fe_eval
from fe_megatron.evaluation.model import EvalModel
from tests.helpers.evaluation import LENGTH, VOCAB, write_jsonl
from tests.helpers.training import CONFIG, ENDS_CLEANLY, ROOT, run_pretrain, small_overrides


def test_perplexity_of_the_uniform_model_is_its_vocabulary(uniform_dir, tmp_path):
    model = EvalModel.load(uniform_dir)
    docs = ["The Congress shall have power to lay and collect taxes.",
            " ".join(["We the people of the United States, in order to form a more perfect union,"] * 24), "Hi"]
    for stride in (LENGTH - 1, 16, 1):
        sums = tasks.perplexity(model, docs, stride)
        lengths = [len(model.encode(doc)) for doc in docs]
        assert max(lengths) > 2 * LENGTH  # rolling windows are exercised
        assert sums["tokens"] == sum(n - 1 for n in lengths)  # every token once, the first of each document never
        result = tasks.summarize_perplexity(sums)
        assert result["token_ppl"] == pytest.approx(VOCAB, rel=1e-9)
        words = sum(len(doc.split()) for doc in docs)
        assert result["word_ppl"] == pytest.approx(math.exp(sums["tokens"] * math.log(VOCAB) / words), rel=1e-9)


def test_rolling_windows_score_each_token_with_the_context_the_stride_leaves():
    """A non-uniform model, token by token: position t is scored in the first window that reaches
    it, reading that window's tokens before it."""
    from tests.helpers.models import tiny_model

    length, stride = 32, 8
    model = EvalModel(tiny_model(), lambda text: [int(b) % 256 for b in text.encode()], None, length, "tiny")
    ids = model.encode("rolling windows over a document longer than the model's context " * 2)
    expected = 0.0
    for t in range(1, len(ids)):
        begin = next(k * stride for k in range(len(ids)) if k * stride + length > t)
        expected -= float(model.logprobs(ids[begin:t + 1])[-1])
    model.encode, text = (lambda _: ids), "x"
    sums = tasks.perplexity(model, [text], stride)
    assert sums["tokens"] == len(ids) - 1
    assert sums["nll"] == pytest.approx(expected, rel=1e-9)


def test_lambada_scores_the_whole_target_word(uniform_dir, tmp_path):
    items = [{"context": "The state of the Union is", "target": "strong"},
             {"text": "We hold these truths to be self-evident"}]
    path = write_jsonl(tmp_path / "lambada.jsonl", items)
    model = EvalModel.load(uniform_dir)
    result = tasks.summarize_lambada(tasks.lambada(model, tasks.read_items(path, ())))
    targets = [len(model.encode("The state of the Union is strong")) - len(model.encode("The state of the Union is")),
               len(model.encode("We hold these truths to be self-evident"))
               - len(model.encode("We hold these truths to be"))]
    assert result["accuracy"] == 0.0  # uniform logits pick token 0, which no word is
    assert result["target_nll"] == pytest.approx(sum(targets) * math.log(VOCAB) / 2, rel=1e-9)
    assert result["ppl"] == pytest.approx(VOCAB, rel=1e-9)


def test_multiple_choice_raw_and_length_normalized(uniform_dir, tmp_path):
    model = EvalModel.load(uniform_dir)
    # uniform: a choice costs (its tokens) x log V. Raw picks the fewest tokens; normalized picks
    # the fewest tokens per character of the choice
    choices = ["zq", "the the the the the"]
    tokens = [len(model.encode(" " + c)) for c in choices]
    raw_pick = min(range(2), key=lambda i: tokens[i])
    norm_pick = min(range(2), key=lambda i: tokens[i] / len(choices[i]))
    assert raw_pick == 0 and norm_pick == 1  # the two scores disagree here

    def evaluate(label):
        items = [{"context_question": "Which?", "choices": choices, "label": label}]
        path = write_jsonl(tmp_path / f"q{label}.jsonl", items)
        return tasks.summarize_mc(tasks.multiple_choice(model, tasks.read_items(path, ("label",)), path))

    assert (evaluate(0)["acc"], evaluate(0)["acc_norm"]) == (1.0, 0.0)
    assert (evaluate(1)["acc"], evaluate(1)["acc_norm"]) == (0.0, 1.0)
    pairs = [{"sentence": "The cup did not fit in the box because the _ was too big.", "option1": "cup",
              "option2": "box", "label": 2}]
    result = tasks.summarize_mc(tasks.multiple_choice(
        model, tasks.read_items(write_jsonl(tmp_path / "w.jsonl", pairs), ("label",)), "w.jsonl"))
    assert result["acc"] == 0.0  # the same continuation scores the same: the tie goes to option 1, not the label


def test_niah_counts_an_exact_answer_as_correct(uniform_dir):
    """The scorer, with a reader that answers from the prompt: it finds the asked key's value."""
    model = EvalModel.load(uniform_dir)

    class Reader(EvalModel):
        def greedy(self, ids, new_tokens):
            import re

            text = self.decode(ids)
            asked = re.search(r"What is the special magic number(?: for (\w+))?\?", text)
            key = f" for {asked.group(1)}" if asked.group(1) else ""
            value = re.search(rf"The special magic number{key} is (\d+)\.", text).group(1)
            return self.encode(" " + value)[:new_tokens]

    reader = Reader(model.model, model.encode, model.decode, model.max_length, "reader")
    haystack = [" ".join(["The grass is green and the sky is blue."] * 60)]
    for variant in (1, 2):
        cells = tasks.niah(reader, haystack, variant, [240], [0.0, 1.0], 2, seed=0)
        assert cells == {"240,0.0": [2, 2], "240,1.0": [2, 2]}
    assert tasks.niah(model, haystack, 1, [240], [0.5], 2, seed=0) == {"240,0.5": [0, 2]}


def test_niah_places_the_needle_at_its_depth_and_scores_exact_answers(uniform_dir, tmp_path):
    model = EvalModel.load(uniform_dir)
    import random

    needles, question, answer = tasks.niah_needles(2, random.Random(0))
    assert len(needles) == 4 and answer.strip() in " ".join(needles)
    haystack = list(range(3, 400))
    for depth in (0.0, 0.5, 1.0):
        prompt = tasks.niah_prompt(model, haystack, needles, question, 240, depth)
        needle_ids = model.encode(" " + " ".join(needles) + " ")
        start = int(round(depth * (240 - len(needle_ids) - len(model.encode(" " + question)))))
        assert len(prompt) == 240 and prompt[start:start + len(needle_ids)] == needle_ids
    hay = write_jsonl(tmp_path / "hay.jsonl", [{"text": "The grass is green and the sky is blue. " * 80}])
    out = tmp_path / "niah.json"
    assert fe_eval(["niah", "--load", uniform_dir, "--haystack", hay, "--context", "224,256", "--variant", "1,2",
                    "--depths", "0,1", "--samples", "2", "--output", str(out)]) == 0
    report = json.load(open(out))
    assert report["NIAH-1"] == 0.0 and len(report["results"]) == 2 * 2 * 2
    assert os.path.isfile(str(out).replace(".json", "_niah1.png"))


def test_bad_input_names_the_file_and_line(uniform_dir, tmp_path, capsys):
    missing = write_jsonl(tmp_path / "bad.jsonl", [{"context_question": "q", "choices": ["a"], "label": 0},
                                                   {"context_question": "q", "choices": ["a"]}])
    assert fe_eval(["mc", "--load", uniform_dir, "--data", missing]) == 2
    assert f"{missing}:2: no 'label' field" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert fe_eval(["lambada", "--load", uniform_dir, "--data", str(empty)]) == 2
    assert "no items (the file is empty)" in capsys.readouterr().err
    hay = write_jsonl(tmp_path / "hay.jsonl", [{"text": "grass " * 500}])
    assert fe_eval(["niah", "--load", uniform_dir, "--haystack", hay, "--context", "4096"]) == 2
    assert "--context 4096 is longer than the model's sequence length 256" in capsys.readouterr().err
    no_checkpoint = tmp_path / "run"
    no_checkpoint.mkdir()
    assert fe_eval(["ppl", "--load", str(no_checkpoint), "--data", hay]) == 2
    assert "is not an fe-pretrain checkpoint directory" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained_run(small_data, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("eval") / "run")
    run_pretrain(["--config", CONFIG, "--save", run] + small_overrides(
        small_data, **{"training.train_steps": 4, "training.save_interval": 4, "optimizer.warmup_steps": 1,
                       "training.eval_interval": 4, "optimizer.lr": 1e-2}))
    return run


def test_a_run_directory_evaluates_like_its_conversion_in_one_process_or_two(trained_run, tmp_path, capfd):
    from fe_megatron.convert.to_hf import mcore_to_hf

    run = trained_run
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": line} for line in [
        "Fellow citizens of the Senate and of the House of Representatives.",
        "The state of the Union is strong, and our economy grows.", "We must do more.", "Thank you."]])
    outputs = {}
    for name, load in (("run", run), ("hf", mcore_to_hf(run, str(tmp_path / "hf")))):
        assert fe_eval(["ppl", "--load", load, "--data", text, "--stride", "32", "--output",
                        str(tmp_path / f"{name}.json")]) == 0
        outputs[name] = json.load(open(tmp_path / f"{name}.json"))["results"][0]
    assert outputs["run"]["token_ppl"] == pytest.approx(outputs["hf"]["token_ppl"], rel=1e-6)
    long_text = write_jsonl(tmp_path / "long.jsonl", [{"text": " ".join(["We must do more for the Union."] * 60)}])
    capfd.readouterr()
    assert fe_eval(["ppl", "--load", str(tmp_path / "hf"), "--data", long_text, "--output",
                    str(tmp_path / "long.json")]) == 0
    assert "Token indices sequence length" not in capfd.readouterr().err  # fe-eval windows the text itself
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    # through ends_cleanly.py: fe-eval ends the gloo group it started, so no thread of it is left to Python's exit
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           ENDS_CLEANLY, "--entry", "fe_megatron.evaluation.cli", "ppl", "--load", run, "--data", text,
                           "--stride", "32", "--output", str(tmp_path / "two.json")], capture_output=True, text=True,
                          cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    two = json.load(open(tmp_path / "two.json"))["results"][0]
    assert two["tokens"] == outputs["run"]["tokens"] and two["documents"] == 4
    assert two["token_ppl"] == pytest.approx(outputs["run"]["token_ppl"], rel=1e-7)  # sums in another order


def test_inspect_reports_every_insertion_layer(trained_run, small_data, tmp_path):
    from fe_megatron.evaluation.inspect import main as fe_inspect

    out = tmp_path / "inspect"
    assert fe_inspect(["--load", trained_run, "--data", small_data["subset"], "--max-tokens", "2000",
                       "--output", str(out)]) == 0
    summary = json.load(open(out / "summary.json"))
    assert sorted(summary) == ["1", "2"]  # factorengram-tiny's layers
    layer = summary["1"]
    assert len(layer["basis_usage"]) == 192 and 0.0 < layer["mean_active"] < 1.0
    assert 0.0 < layer["z_below_threshold"] < 1.0
    assert sorted(layer["gates_by_order"]) == ["1", "2", "3"]
    assert all(0.0 < g["mean"] < 1.0 for g in layer["gates_by_order"].values())
    assert sorted(layer["collisions"], key=int) == ["2", "3", "4", "5"]  # the hashed (bigram, trigram) branches
    assert all(c["distinct_ngrams"] > 100 for c in layer["collisions"].values())
    assert (out / "basis_usage.png").is_file() and (out / "gates_by_order.png").is_file()
    # threshold 0: nothing is below it, every coefficient is active everywhere
    assert fe_inspect(["--load", trained_run, "--data", small_data["subset"], "--max-tokens", "300",
                       "--threshold", "0", "--output", str(tmp_path / "zero")]) == 0
    zero = json.load(open(tmp_path / "zero" / "summary.json"))["2"]
    assert zero["z_below_threshold"] == 0.0 and zero["never_active"] == 0 and zero["mean_active"] == 1.0
