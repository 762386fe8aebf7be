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
BATCH_TOKENS = 4096  # default windows per forward pass: as many as hold this many tokens (at least one)


def rolling_windows(count: int, length: int, stride: int) -> list:
    """``[(begin, end, first)]``: the windows ``ids[begin:end]`` that score a document of ``count``
    tokens, and the first log-probability of each that is new (``logprobs(ids[begin:end])[first:]``
    scores positions ``begin + first + 1 .. end - 1``).  Windows of ``length`` tokens advance by
    ``stride``; each token is scored once, in the first window that reaches it, so with at least
    ``length - stride`` tokens of context (all of them inside the first window); position 0 never."""
    windows, scored_to = [], 1  # position 0 has no context
    for begin in range(0, max(count - 1, 1), stride):
        end = min(begin + length, count)
        if end <= scored_to:
            break
        windows.append((begin, end, scored_to - begin - 1))
        scored_to = end
        if end == count:
            break
    return windows


def perplexity(model, documents: list, stride: int, batch_size: int = None) -> dict:
    """Rolling-window perplexity (WikiText style, `rolling_windows`): windows of the model's length
    advance by ``stride`` tokens, and each token is scored once, in the first window that reaches it,
    with at least ``max_length - stride`` tokens of context.  The first token of each document is
    not scored.  The windows of all documents go through the model ``batch_size`` at a time (default:
    as many as hold `BATCH_TOKENS` tokens), longest first, padded on the right; the per-token
    log-probabilities are those of one window at a time (fp32 forward, fp64 log-softmax).  Returns
    ``{"nll", "tokens", "words", "documents"}`` sums."""
    length = model.max_length
    if not 0 < stride < length:
        raise ValueError(f"--stride {stride} must lie in [1, {length - 1}]: below the model's sequence length "
                         f"{length}, so that every window's new tokens have context")
    if batch_size is None:
        batch_size = max(1, BATCH_TOKENS // length)
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    sums = {"nll": 0.0, "tokens": 0}

    def score(pending: list) -> None:
        pending.sort(key=lambda window: -len(window[0]))  # rows of a batch then pad little
        for index in range(0, len(pending), batch_size):
            batch = pending[index:index + batch_size]
            for logprobs in model.logprobs_batch([ids for ids, _ in batch], [first for _, first in batch]):
                sums["nll"] -= float(logprobs.sum())
                sums["tokens"] += logprobs.numel()
        pending.clear()

    pending, words = [], 0
    for text in documents:
        ids = model.encode(text)
        words += len(text.split())
        pending += [(ids[begin:end], first) for begin, end, first in rolling_windows(len(ids), length, stride)]
        if len(pending) >= 16 * batch_size:  # sort and score a chunk at a time, not the whole file at once
            score(pending)
    score(pending)
    return {"nll": sums["nll"], "tokens": sums["tokens"], "words": words, "documents": len(documents)}


def summarize_perplexity(sums: dict) -> dict:
    """``token_ppl`` = exp(NLL per token); ``word_ppl`` = exp(NLL per whitespace-separated word) =
    ``token_ppl ** tokens_per_word``."""
    return {"token_ppl": math.exp(sums["nll"] / sums["tokens"]), "word_ppl": math.exp(sums["nll"] / sums["words"]),
            "tokens_per_word": sums["tokens"] / sums["words"], **sums}


PPL_LEGEND = {
    "token_ppl": "exp(total NLL / scored tokens); the first token of each document is not scored",
    "word_ppl": "exp(total NLL / whitespace-separated words) = token_ppl ** tokens_per_word",
    "tokens_per_word": "scored tokens per whitespace-separated word",
}


def word_ppl_note(rows: list) -> str:
    """The line printed under a table that reports word perplexity."""
    powers = ", ".join(f"{row['tokens_per_word']:.2f}" for row in rows)
    return (f"word_ppl = exp(total NLL / whitespace-separated words) = token_ppl ** tokens_per_word ({powers} here), "
            "so it exceeds token_ppl by that power: in the thousands or millions for small models")


# ----------------------------------------------------------------------------- LAMBADA
def lambada_item(record: dict) -> tuple:
    """``(context, target word)``: ``{"context", "target"}``, or ``{"text"}`` whose last word is the target."""
    if "text" in record and "target" not in record:
        context, _, target = record["text"].rstrip().rpartition(" ")
        return context, target
    return record["context"].rstrip(), record["target"].strip()


def read_lambada_items(path: str) -> list:
    """`read_items` of a LAMBADA file: ``{"context", "target"}`` or ``{"text"}`` records."""
    items = read_items(path, ())
    for line_no, record in items:
        if not isinstance(record, dict) or not ({"context", "target"} <= set(record) or "text" in record):
            found = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{line_no}: expected 'context' and 'target' fields (or 'text', whose last word is "
                            f"the target), found {found}")
    return items


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


LAMBADA_LEGEND = {
    "accuracy": "share of items whose target word greedy decoding predicts token for token",
    "target_word_nll": "nats per target word: the NLL summed over the word's tokens, averaged over the items "
                       "(also written as target_nll)",
    "target_token_ppl": "perplexity per target token: exp(total target NLL / target tokens) (also written as ppl)",
}


LAMBADA_NOTE = ("target_word_nll: nats per target word (its tokens' NLL summed, averaged over items); "
                "target_token_ppl: exp(total target NLL / target tokens)")


def summarize_lambada(sums: dict) -> dict:
    """`LAMBADA_LEGEND`'s numbers; ``target_nll`` and ``ppl`` repeat ``target_word_nll`` and
    ``target_token_ppl`` under the names of earlier reports."""
    word_nll, token_ppl = sums["nll"] / sums["items"], math.exp(sums["nll"] / sums["target_tokens"])
    return {"accuracy": sums["correct"] / sums["items"], "target_word_nll": word_nll, "target_token_ppl": token_ppl,
            "target_tokens_per_word": sums["target_tokens"] / sums["items"], "target_nll": word_nll, "ppl": token_ppl,
            **sums}


# ----------------------------------------------------------------------------- multiple choice
MC_FORMATS = {"question": ("context_question", "choices", "label"),
              "winogrande": ("sentence", "option1", "option2", "label")}
MC_FIELDS = ("context_question (the context and the question in one string), choices (a list of strings) and label "
             "(the 0-based index of the right choice); or, for WinoGrande pairs, sentence (with one '_' blank), "
             "option1, option2 and label (1 or 2)")


def mc_format(record: dict) -> str:
    """``"question"`` or ``"winogrande"`` (`MC_FORMATS`); KeyError for neither."""
    for kind, fields in MC_FORMATS.items():
        if isinstance(record, dict) and set(fields) <= set(record):
            return kind
    raise KeyError


def mc_problem(record) -> str:
    """Why a record is no multiple-choice item ("" when it is one), naming the accepted fields."""
    if not isinstance(record, dict):
        return f"a multiple-choice item is a JSON object, found a {type(record).__name__}; its fields: {MC_FIELDS}"
    try:
        kind = mc_format(record)
    except KeyError:
        closest = max(MC_FORMATS.values(), key=lambda fields: len(set(fields) & set(record)))
        missing = [key for key in closest if key not in record]
        hint = ""
        if "question" in record and "context_question" not in record:
            hint = " (rename 'question' to 'context_question', the name lm_eval_tasks reads too)"
        return (f"no '{missing[0]}' field (found: {sorted(record)}){hint}; multiple-choice items have the fields "
                f"{MC_FIELDS}")
    if kind == "question":
        choices = record["choices"]
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            return f"'choices' must be a non-empty list of strings, found {choices!r}"
    if isinstance(record["label"], bool) or not isinstance(record["label"], (int, str)) or \
            not str(record["label"]).strip().isdigit():
        return f"'label' must be a non-negative whole number, found {record['label']!r}"
    return ""


def read_mc_items(path: str) -> list:
    """`read_items` of a multiple-choice file, each record checked by `mc_problem`."""
    items = read_items(path, ())
    for line_no, record in items:
        problem = mc_problem(record)
        if problem:
            raise DataError(f"{path}:{line_no}: {problem}")
    return items


def multiple_choice(model, items: list, path: str) -> dict:
    """Accuracy by log-likelihood, raw and divided by the choice's length in characters (without
    the leading space; lm-evaluation-harness's ``acc_norm``).  Question items score ``" " + choice`` after
    ``Question: ...\\nAnswer:``; WinoGrande pairs score the rest of the sentence after the blank
    filled by each option (partial scoring)."""
    raw, normalized = 0, 0
    for line_no, record in items:
        problem = mc_problem(record)
        if problem:
            raise DataError(f"{path}:{line_no}: {problem}")
        kind = mc_format(record)
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
