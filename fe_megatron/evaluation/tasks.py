"""The evaluations of ``fe-eval``: perplexity, LAMBADA, multiple choice and needle-in-a-haystack.

Each takes an `EvalModel` and the items of this rank (``rank::world``) and returns sums that
add up across ranks (`fe_megatron.evaluation.cli` all-reduces them), then `summarize` turns the
sums into the reported numbers.
"""

from __future__ import annotations

import math
import random

from fe_megatron.data.sources import DataError, iter_documents, iter_json_records


def read_items(path: str, required: tuple) -> list:
    """``[(line, record)]`` of a jsonl file whose records all have the ``required`` fields."""
    items = []
    for line_no, record in iter_json_records(path):
        missing = [key for key in required if not isinstance(record, dict) or key not in record]
        if missing:
            found = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{line_no}: no '{missing[0]}' field (found: {found})")
        items.append((line_no, record))
    if not items:
        raise DataError(f"{path}: no items (the file is empty)")
    return items


# ----------------------------------------------------------------------------- perplexity
def perplexity(model, documents: list, stride: int) -> dict:
    """Rolling-window perplexity (WikiText style): windows of the model's length advance by
    ``stride`` tokens, and each token is scored once, in the first window that reaches it, with at
    least ``max_length - stride`` tokens of context (all of them inside the first window).  The
    first token of each document is not scored.  Returns ``{"nll", "tokens", "words",
    "documents"}`` sums."""
    length = model.max_length
    if not 0 < stride < length:
        raise ValueError(f"--stride {stride} must lie in [1, {length - 1}]: below the model's sequence length "
                         f"{length}, so that every window's new tokens have context")
    nll, tokens, words = 0.0, 0, 0
    for text in documents:
        ids = model.encode(text)
        words += len(text.split())
        scored_to = 1  # position 0 has no context
        for begin in range(0, max(len(ids) - 1, 1), stride):
            end = min(begin + length, len(ids))
            if end <= scored_to:
                break
            logprobs = model.logprobs(ids[begin:end])  # positions begin+1 .. end-1
            new = logprobs[scored_to - begin - 1:]
            nll -= float(new.sum())
            tokens += new.numel()
            scored_to = end
            if end == len(ids):
                break
    return {"nll": nll, "tokens": tokens, "words": words, "documents": len(documents)}


def summarize_perplexity(sums: dict) -> dict:
    return {"token_ppl": math.exp(sums["nll"] / sums["tokens"]), "word_ppl": math.exp(sums["nll"] / sums["words"]),
            **sums}


# ----------------------------------------------------------------------------- LAMBADA
def lambada_item(record: dict) -> tuple:
    """``(context, target word)``: ``{"context", "target"}``, or ``{"text"}`` whose last word is the target."""
    if "text" in record and "target" not in record:
        context, _, target = record["text"].rstrip().rpartition(" ")
        return context, target
    return record["context"].rstrip(), record["target"].strip()


def lambada(model, items: list, path: str = "") -> dict:
    """Last-word accuracy (every token of the target word predicted greedily) and target NLL."""
    correct, nll, tokens = 0, 0.0, 0
    for line_no, record in items:
        context, target = lambada_item(record)
        if not context or not target:
            raise DataError(f"{path}:{line_no}: the item needs a context and a target word, got context "
                            f"{context!r} and target {target!r}")
        context_ids = model.encode(context)
        full = model.encode(f"{context} {target}")
        # the target's tokens are what the full text adds to the context (tokenizers may merge the space)
        common = 0
        while common < min(len(context_ids), len(full)) and context_ids[common] == full[common]:
            common += 1
        target_ids = full[common:]
        logprobs, greedy = model.continuation(full[:common], target_ids)
        correct += int(greedy)
        nll -= float(logprobs.sum())
        tokens += len(target_ids)
    return {"correct": correct, "items": len(items), "nll": nll, "target_tokens": tokens}


def summarize_lambada(sums: dict) -> dict:
    return {"accuracy": sums["correct"] / sums["items"], "target_nll": sums["nll"] / sums["items"],
            "ppl": math.exp(sums["nll"] / sums["target_tokens"]), **sums}


# ----------------------------------------------------------------------------- multiple choice
def mc_format(record: dict) -> str:
    if {"context_question", "choices", "label"} <= set(record):
        return "question"
    if {"sentence", "option1", "option2", "label"} <= set(record):
        return "winogrande"
    raise KeyError


def multiple_choice(model, items: list, path: str) -> dict:
    """Accuracy by log-likelihood, raw and divided by the choice's length in characters (without
    the leading space; lm-evaluation-harness's ``acc_norm``).  Question items score ``" " + choice`` after
    ``Question: ...\\nAnswer:``; WinoGrande pairs score the rest of the sentence after the blank
    filled by each option (partial scoring)."""
    raw, normalized = 0, 0
    for line_no, record in items:
        try:
            kind = mc_format(record)
        except KeyError:
            raise DataError(f"{path}:{line_no}: expected context_question/choices/label or "
                            f"sentence/option1/option2/label fields, found {sorted(record)}") from None
        if kind == "question":
            context = model.encode(f"Question: {record['context_question']}\nAnswer:")
            options = [(context, f" {choice}") for choice in record["choices"]]  # scored with the space
            label = int(record["label"])
        else:
            before, _, after = record["sentence"].partition("_")
            options = [(model.encode(before + record[key]), " " + after.strip()) for key in ("option1", "option2")]
            label = int(record["label"]) - 1
        if not 0 <= label < len(options):
            raise DataError(f"{path}:{line_no}: label {record['label']} is outside the {len(options)} choices")
        scores = []
        for context, continuation in options:
            logprobs, _ = model.continuation(context, model.encode(continuation))
            scores.append((float(logprobs.sum()), float(logprobs.sum()) / max(len(continuation.strip()), 1)))
        raw += int(max(range(len(scores)), key=lambda i: scores[i][0]) == label)
        normalized += int(max(range(len(scores)), key=lambda i: scores[i][1]) == label)
    return {"correct": raw, "correct_norm": normalized, "items": len(items)}


def summarize_mc(sums: dict) -> dict:
    return {"acc": sums["correct"] / sums["items"], "acc_norm": sums["correct_norm"] / sums["items"], **sums}


# ----------------------------------------------------------------------------- needle in a haystack
def _number(rng) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _uuid(rng) -> str:
    digits = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


KEYS = ("apple", "river", "violet", "engine", "harbor", "candle", "meadow", "silver", "falcon", "orchard")


def niah_needles(variant: int, rng) -> tuple:
    """``(needle sentences, question, answer)`` of NIAH-1 (one number), NIAH-2 (several keys with
    numbers, one asked for; the others distract) or NIAH-3 (several keys with UUID-like values)."""
    if variant == 1:
        value = _number(rng)
        return [f"The special magic number is {value}."], "What is the special magic number? The special " \
                                                          "magic number is", f" {value}"
    keys = rng.sample(KEYS, 4)
    make = _number if variant == 2 else _uuid
    values = [make(rng) for _ in keys]
    noun = "number" if variant == 2 else "code"
    needles = [f"The special magic {noun} for {key} is {value}." for key, value in zip(keys, values)]
    asked = rng.randrange(len(keys))
    return needles, f"What is the special magic {noun} for {keys[asked]}? The special magic {noun} for " \
                    f"{keys[asked]} is", f" {values[asked]}"


def niah_prompt(model, haystack_ids: list, needles: list, question: str, context: int, depth: float) -> list:
    """Haystack tokens around the needles (placed together at ``depth`` of the haystack), then the
    question: ``context`` tokens in all."""
    needle_ids = model.encode(" " + " ".join(needles) + " ")
    question_ids = model.encode(" " + question)
    fill = context - len(needle_ids) - len(question_ids)
    if fill < 0:
        raise ValueError(f"context {context} is too short for the needles and the question "
                         f"({len(needle_ids) + len(question_ids)} tokens)")
    if len(haystack_ids) < fill:
        raise ValueError(f"the haystack has {len(haystack_ids)} tokens; context {context} needs {fill}: give a "
                         "longer --haystack file")
    cut = int(round(depth * fill))
    return haystack_ids[:cut] + needle_ids + haystack_ids[cut:fill] + question_ids


def niah(model, haystack: list, variant: int, contexts: list, depths: list, samples: int, seed: int,
         rank: int = 0, world: int = 1) -> dict:
    """Exact-match accuracy of greedy answers per ``(context, depth)`` cell: ``{"context,depth":
    [correct, samples]}`` (this rank's share of the samples).  The prompt and the answer together
    take ``context`` tokens."""
    longest = max(contexts)
    if longest > model.max_length:
        raise ValueError(f"--context {longest} is longer than the model's sequence length {model.max_length}")
    haystack_ids = []
    for text in haystack:
        haystack_ids += model.encode(text + "\n")
        if len(haystack_ids) >= longest:
            break
    cells = {}
    for context in contexts:
        for depth in depths:
            correct, done = 0, 0
            for sample in range(samples):
                rng = random.Random(f"{seed}-{variant}-{context}-{depth}-{sample}")
                if (sample + context) % world != rank:
                    continue
                needles, question, answer = niah_needles(variant, rng)
                answer_ids = model.encode(answer)
                prompt = niah_prompt(model, haystack_ids, needles, question, context - len(answer_ids), depth)
                correct += int(model.greedy(prompt, len(answer_ids)) == answer_ids)
                done += 1
            cells[f"{context},{depth}"] = [correct, done]
    return cells


def read_haystack(path: str) -> list:
    return list(iter_documents([path]))
