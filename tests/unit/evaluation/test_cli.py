"""fe-eval (`fe_megatron.evaluation.cli`) as its users meet it: where the reports go, what the printed
numbers mean, bad input named by file and line, and the example files of ``examples/eval/``."""

import glob
import json
import math
import os

import pytest

from fe_megatron.evaluation import tasks
from fe_megatron.evaluation.cli import main as fe_eval
from tests.helpers.evaluation import LENGTH, write_jsonl
from tests.helpers.paths import ROOT


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


EXAMPLES = os.path.join(ROOT, "examples", "eval")


# ----------------------------------------------------------------------------- output files
def test_default_report_names_follow_the_input_and_never_replace_another_evaluation(uniform_dir, tmp_path,
                                                                                      capsys):
    items = [{"context_question": "Which?", "choices": ["yes", "no"], "label": 0}]
    first = write_jsonl(tmp_path / "arc.jsonl", items)
    second = write_jsonl(tmp_path / "piqa.jsonl", items)
    os.mkdir(tmp_path / "other")
    same_name = write_jsonl(tmp_path / "other" / "arc.jsonl", items * 2)
    eval_dir = os.path.join(uniform_dir, "eval")

    def run(path):
        assert fe_eval(["mc", "--load", uniform_dir, "--data", path]) == 0
        return capsys.readouterr().out.strip().splitlines()[-1]

    assert run(first) == f"wrote the results to {eval_dir}/mc-arc.json"
    assert run(second) == f"wrote the results to {eval_dir}/mc-piqa.json"
    assert json.load(open(f"{eval_dir}/mc-arc.json"))["settings"]["data"] == [first]  # the first is still there
    assert run(same_name) == (f"wrote the results to {eval_dir}/mc-arc-2.json ({eval_dir}/mc-arc.json holds the "
                              "results of another evaluation (model, inputs or settings) and is kept)")
    assert json.load(open(f"{eval_dir}/mc-arc.json"))["results"][0]["items"] == 1
    assert json.load(open(f"{eval_dir}/mc-arc-2.json"))["results"][0]["items"] == 2
    # the same evaluation again replaces its own report, and says so
    assert run(first) == f"wrote the results to {eval_dir}/mc-arc.json (replacing the earlier results of the " \
                         "same evaluation)"
    assert sorted(os.listdir(eval_dir)) == ["mc-arc-2.json", "mc-arc.json", "mc-piqa.json"]
    assert fe_eval(["mc", "--load", uniform_dir, "--data", first, second]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{eval_dir}/mc-arc+piqa.json")


# ----------------------------------------------------------------------------- units of the printed numbers
def test_lambada_and_ppl_say_what_their_numbers_are(uniform_dir, tmp_path, capsys):
    out = tmp_path / "lambada.json"
    assert fe_eval(["lambada", "--load", uniform_dir, "--data", f"{EXAMPLES}/lambada.jsonl", "--output",
                    str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["file", "accuracy", "target_word_nll", "target_token_ppl", "target_tokens_per_word",
                                  "items"]
    assert printed[2] == ("target_word_nll: nats per target word (its tokens' NLL summed, averaged over items); "
                          "target_token_ppl: exp(total target NLL / target tokens)")
    report = json.load(open(out))
    row = report["results"][0]
    assert row["target_token_ppl"] == pytest.approx(512, rel=1e-9) == row["ppl"]  # the uniform model: log V a token
    assert row["target_word_nll"] == pytest.approx(row["target_tokens_per_word"] * math.log(512), rel=1e-9)
    assert row["target_nll"] == row["target_word_nll"] and set(report["legend"]) == set(tasks.LAMBADA_LEGEND)

    out = tmp_path / "ppl.json"
    assert fe_eval(["ppl", "--load", uniform_dir, "--data", f"{EXAMPLES}/ppl.jsonl", "--output", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    row = json.load(open(out))["results"][0]
    assert "tokens_per_word" in printed[0].split()
    assert printed[2] == (f"word_ppl = exp(total NLL / whitespace-separated words) = token_ppl ** tokens_per_word "
                          f"({row['tokens_per_word']:.2f} here), so it exceeds token_ppl by that power: in the "
                          "thousands or millions for small models")
    assert row["word_ppl"] == pytest.approx(row["token_ppl"] ** row["tokens_per_word"], rel=1e-9)
    assert row["word_ppl"] > 1e6  # 512 ** (tokens per word > 2.3): what the note is for


# ----------------------------------------------------------------------------- multiple-choice fields
@pytest.mark.parametrize("record, message", [
    ({"question": "Which?", "choices": ["a", "b"], "label": 0},
     "no 'context_question' field (found: ['choices', 'label', 'question']) (rename 'question' to "
     "'context_question', the name lm_eval_tasks reads too); multiple-choice items have the fields context_question"),
    ({"context_question": "Which?", "choices": ["a", "b"]}, "no 'label' field"),
    ({"sentence": "The _ fell.", "option1": "cup", "label": 1}, "no 'option2' field"),
    ({"context_question": "Which?", "choices": "a or b", "label": 0}, "'choices' must be a non-empty list of strings"),
    ({"context_question": "Which?", "choices": ["a", "b"], "label": "first"}, "'label' must be a non-negative whole"),
    (["a", "b"], "a multiple-choice item is a JSON object, found a list"),
])
def test_a_bad_multiple_choice_item_names_the_accepted_fields(uniform_dir, tmp_path, capsys, record, message):
    path = write_jsonl(tmp_path / "mc.jsonl", [{"context_question": "Fine?", "choices": ["yes"], "label": 0}, record])
    assert fe_eval(["mc", "--load", uniform_dir, "--data", path, "--output", str(tmp_path / "out.json")]) == 2
    error = capsys.readouterr().err
    assert f"{path}:2: {message}" in error
    if "field" in message:
        assert tasks.MC_FIELDS in error
        assert "sentence (with one '_' blank), option1, option2 and label (1 or 2)" in error
    assert not os.path.exists(tmp_path / "out.json")


# ----------------------------------------------------------------------------- examples/eval
def test_every_example_file_is_documented():
    names = sorted(os.path.basename(p) for p in glob.glob(f"{EXAMPLES}/*.jsonl"))
    assert names == ["arc_like.jsonl", "haystack.jsonl", "lambada.jsonl", "ppl.jsonl", "social_iqa.jsonl",
                     "winogrande_pairs.jsonl"]
    docs = open(os.path.join(ROOT, "docs", "evaluation.md")).read()
    assert all(f"examples/eval/{name}" in docs for name in names)


def test_the_example_files_read_and_evaluate(uniform_dir, tmp_path):
    assert len(list(tasks.iter_documents([f"{EXAMPLES}/ppl.jsonl"]))) >= 3
    lambada = tasks.read_lambada_items(f"{EXAMPLES}/lambada.jsonl")
    assert len(lambada) >= 5 and all(all(tasks.lambada_item(record)) for _, record in lambada)
    for name, kind in (("arc_like", "question"), ("social_iqa", "question"), ("winogrande_pairs", "winogrande")):
        items = tasks.read_mc_items(f"{EXAMPLES}/{name}.jsonl")
        assert len(items) >= 4 and {tasks.mc_format(record) for _, record in items} == {kind}
    haystack = tasks.read_haystack(f"{EXAMPLES}/haystack.jsonl")
    assert sum(len(text.split()) for text in haystack) > 600

    def evaluate(*args):
        out = str(tmp_path / f"{args[0]}.json")
        assert fe_eval([*args, "--load", uniform_dir, "--output", out]) == 0
        return json.load(open(out))

    assert evaluate("ppl", "--data", f"{EXAMPLES}/ppl.jsonl")["results"][0]["documents"] == 5
    assert evaluate("lambada", "--data", f"{EXAMPLES}/lambada.jsonl")["results"][0]["items"] == len(lambada)
    mc = evaluate("mc", "--data", *(f"{EXAMPLES}/{n}.jsonl" for n in ("arc_like", "social_iqa", "winogrande_pairs")))
    assert [row["items"] for row in mc["results"]] == [5, 4, 4]
    niah = evaluate("niah", "--haystack", f"{EXAMPLES}/haystack.jsonl", "--context", str(LENGTH), "--variant", "1",
                    "--depths", "0.5", "--samples", "1")
    assert niah["results"][0]["samples"] == 1
