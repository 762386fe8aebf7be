"""`fe_megatron.evaluation.tasks` against hand computations: a model whose every weight is zero predicts
the uniform distribution over its vocabulary V, so each token costs exactly log V; perplexity's rolling
windows and batches, LAMBADA, multiple choice and needle in a haystack."""

import json
import math
import os

import pytest
import torch

from fe_megatron.evaluation import tasks
from fe_megatron.evaluation.cli import main as fe_eval
from fe_megatron.evaluation.model import EvalModel
from tests.helpers.evaluation import LENGTH, VOCAB, write_jsonl
from tests.helpers.models import tiny_model
from tests.helpers.paths import ROOT


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


def byte_model(length=32):
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


def test_the_documented_multiple_choice_fields_are_the_ones_read():
    docs = open(os.path.join(ROOT, "docs", "huggingface.md")).read() + open(os.path.join(ROOT, "docs",
                                                                                      "evaluation.md")).read()
    assert "(question, choices, label" not in docs
    for fields in tasks.MC_FORMATS.values():
        assert all(f"`{field}`" in docs for field in fields)
