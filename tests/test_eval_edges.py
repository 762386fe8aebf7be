"""fe-eval as its users meet it: batched perplexity, where the reports go, what the printed numbers
mean, the multiple-choice fields, and the example files of ``examples/eval/``."""

import ast
import glob
import json
import math
import os

import pytest
import torch

from fe_megatron.evaluation import tasks
from fe_megatron.evaluation.cli import main as fe_eval
from fe_megatron.evaluation.model import EvalModel
from tests.helpers.evaluation import LENGTH, write_jsonl
from tests.helpers.paths import ROOT

EXAMPLES = os.path.join(ROOT, "examples", "eval")


def byte_model(length=32):
    from tests.helpers.models import tiny_model

    return EvalModel(tiny_model(), lambda text: [int(b) % 256 for b in text.encode()], None, length, "tiny")


DOCS = ["a short one", "x",
        "rolling windows over a document longer than the model's context, " * 3,
        "another document of a different length, to pad against the others " * 2,
        "the last document, of about one window " * 1]


# ----------------------------------------------------------------------------- ppl batching
def test_rolling_windows_score_every_token_once_with_the_stride_context():
    for count, length, stride in ((1, 8, 4), (2, 8, 4), (8, 8, 4), (9, 8, 4), (100, 32, 8), (100, 32, 31), (57, 16, 1)):
        scored = []
        for begin, end, first in tasks.rolling_windows(count, length, stride):
            assert end - begin <= length
            positions = list(range(begin + first + 1, end))
            assert positions and (begin == 0 or positions[0] - begin >= length - stride)
            scored += positions
        assert scored == list(range(1, count)) or (count == 1 and scored == [])


def test_batched_perplexity_gives_each_token_the_log_probability_of_its_window_alone():
    model = byte_model()
    length, stride = model.max_length, 8
    windows = [(ids[begin:end], first) for ids in map(model.encode, DOCS)
               for begin, end, first in tasks.rolling_windows(len(ids), length, stride)]
    assert len({len(ids) for ids, _ in windows}) > 3  # rows of several lengths share a padded batch
    batched = model.logprobs_batch([ids for ids, _ in windows], [first for _, first in windows])
    for (ids, first), row in zip(windows, batched):
        alone = model.logprobs(ids)[first:]
        assert row.dtype == torch.float64 and row.shape == alone.shape
        torch.testing.assert_close(row, alone, rtol=1e-5, atol=1e-5)  # fp32 forward in another batch shape
    one = tasks.perplexity(model, DOCS, stride, batch_size=1)
    for batch_size in (3, 64, None):
        sums = tasks.perplexity(model, DOCS, stride, batch_size=batch_size)
        assert sums["tokens"] == one["tokens"] == sum(len(model.encode(d)) - 1 for d in DOCS)
        assert sums["nll"] == pytest.approx(one["nll"], rel=1e-6)
    with pytest.raises(ValueError, match="--batch-size must be at least 1"):
        tasks.perplexity(model, DOCS, stride, batch_size=0)


def test_perplexity_runs_batch_size_windows_per_forward_pass():
    model = byte_model()
    calls = []
    forward = model.model.forward
    model.model.forward = lambda input_ids, **kw: calls.append(input_ids.shape[0]) or forward(input_ids, **kw)
    windows = sum(len(tasks.rolling_windows(len(model.encode(d)), 32, 8)) for d in DOCS)
    tasks.perplexity(model, DOCS, 8, batch_size=4)
    assert sum(calls) == windows and len(calls) == math.ceil(windows / 4)
    calls.clear()
    tasks.perplexity(model, DOCS, 8)  # default: 4096 tokens' worth of 32-token windows
    assert calls == [windows]


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


def test_the_documented_multiple_choice_fields_are_the_ones_read():
    docs = open(os.path.join(ROOT, "docs", "huggingface.md")).read() + open(os.path.join(ROOT, "docs",
                                                                                      "evaluation.md")).read()
    assert "(question, choices, label" not in docs
    for fields in tasks.MC_FORMATS.values():
        assert all(f"`{field}`" in docs for field in fields)


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


def test_the_example_files_render_through_the_lm_eval_tasks(tmp_path):
    import yaml

    from fe_megatron.hf.lm_eval_tasks import write_tasks

    apply_template = pytest.importorskip("lm_eval.utils").apply_template
    assert write_tasks(EXAMPLES, str(tmp_path)) == ["fe_social_iqa", "fe_arc_like", "fe_winogrande"]
    for task in ("fe_social_iqa", "fe_arc_like", "fe_winogrande"):
        spec = yaml.safe_load(open(tmp_path / f"{task}.yaml"))
        for _, doc in tasks.iter_json_records(spec["dataset_kwargs"]["data_files"]["test"]):
            text = apply_template(spec["doc_to_text"], doc)
            choices = ast.literal_eval(apply_template(spec["doc_to_choice"], doc))
            target = apply_template(spec["doc_to_target"], doc)
            assert len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)
            if task == "fe_winogrande":  # the text is the index of the right context; the target is shared
                assert int(text) in (0, 1) and choices[int(text)].endswith(doc[f"option{doc['label']}"])
                assert target and target == doc["sentence"].split("_", 1)[1].strip()
            else:
                assert text.startswith("Question: ") and text.endswith("\nAnswer:")
                assert choices == doc["choices"] and 0 <= int(target) < len(choices)
