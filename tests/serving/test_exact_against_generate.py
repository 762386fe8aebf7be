"""vLLM serves a converted FactorEngram (or Engram) model token for token as transformers' ``generate``, at vLLM's
defaults: compiled (the memory's custom ops left whole), prefix caching on; and with speculative decoding.

One engine per model, with a step budget of 32 tokens (a 90-token prompt is prefilled in three chunks, so the
n-gram ids and the convolution's values must cross each split), at most 4 running requests (the others wait
and join while earlier ones decode), requests added while others decode, and a KV cache of 12 blocks of 16
tokens, too small for four long requests at once, so vLLM preempts and recomputes some.  Greedy tokens must
equal ``generate``'s and their log-probs agree to 1e-4; the memory changes the tokens, so a lost look-back
would show.  Then, in the same engine, five prompts that share a 40-token prefix, one after another: the later
ones skip the cached blocks (prefix caching), with the same tokens and log-probs as ``generate``, which has no cache.
"""

import pytest

from tests.helpers.serving import (counter, engine, generate_greedy, random_prompts, require_vllm,
                                   save_tiny_model, traced_without_inductor, without_memory)

vllm = require_vllm()

PROMPT_LENGTHS = (5, 9, 90, 17, 40, 3, 70, 12, 25, 2)
NEW_TOKENS = (24, 16, 20, 30, 12, 40, 18, 24, 8, 30)
STEP_TOKENS = 32
SHARING_NEW_TOKENS = (12, 20, 8, 16, 10)


def assert_vllm_s_defaults(llm):
    from vllm.config import CompilationMode

    config = llm.llm_engine.vllm_config
    assert config.compilation_config.mode != CompilationMode.NONE and not config.model_config.enforce_eager
    assert config.cache_config.enable_prefix_caching and config.cache_config.mamba_cache_mode == "align"


def assert_as_generate(served, expected):
    for index, reference in enumerate(expected):
        tokens, logprobs = served[index]
        assert tokens == reference.tokens, f"prompt {index}"
        assert logprobs == pytest.approx(reference.logprobs, abs=1e-4), f"prompt {index}"


def serve_in_order(llm, prompts, new_tokens) -> dict:
    """Each prompt in turn, to its end: ``{index: (tokens, log-probs)}``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    served = {}
    for index, (prompt, count) in enumerate(zip(prompts, new_tokens)):
        params = SamplingParams(max_tokens=count, min_tokens=count, temperature=0.0, ignore_eos=True, logprobs=0)
        completion = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
        served[index] = (list(completion.token_ids),
                         [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)])
    return served


def serve_with_late_arrivals(llm, prompts, new_tokens, first=5):
    """Add ``first`` requests, step until all of them decode, add the rest while they decode, and run to the
    end: ``{index: (tokens, log-probs)}``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    results = {}

    def add(index):
        params = SamplingParams(max_tokens=new_tokens[index], min_tokens=new_tokens[index], temperature=0.0,
                                ignore_eos=True, logprobs=0)
        engine.add_request(str(index), TokensPrompt(prompt_token_ids=prompts[index]), params)

    def collect(outputs):
        for output in outputs:
            if output.finished:
                completion = output.outputs[0]
                results[int(output.request_id)] = (list(completion.token_ids), [
                    step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)])

    for index in range(first):
        add(index)
    decoding_steps = 0
    while decoding_steps < 3:  # every first request is past its prompt (the longest takes three chunks)
        collect(engine.step())
        decoding_steps += 1 if len(results) < first else 0
    for index in range(first, len(prompts)):
        add(index)
        collect(engine.step())
    while engine.has_unfinished_requests():
        collect(engine.step())
    return results


@pytest.mark.parametrize("kind, placement, table_dtype", [("factorengram", "before_attn", "fp32"),
                                                         ("engram", "before_ffn", "bf16")])
def test_greedy_tokens_equal_generate_under_chunks_batching_and_preemption(tmp_path, kind, placement, table_dtype):
    model = save_tiny_model(tmp_path / "model", kind, placement, table_dtype)
    prompts = random_prompts(PROMPT_LENGTHS)
    expected = [generate_greedy(model, prompt, new) for prompt, new in zip(prompts, NEW_TOKENS)]
    plain = without_memory(model)
    assert any(generate_greedy(plain, prompt, new).tokens != reference.tokens
               for prompt, new, reference in zip(prompts, NEW_TOKENS, expected)), "the memory changes no token"

    shared = random_prompts((40,), seed=7)[0]  # prompts that share two and a half blocks of 16
    sharing = [shared + tail for tail in random_prompts((3, 21, 9, 30), seed=8)] + [shared[:35]]
    sharing_expected = [generate_greedy(model, prompt, new) for prompt, new in zip(sharing, SHARING_NEW_TOKENS)]

    with engine(tmp_path / "model", max_num_batched_tokens=STEP_TOKENS, max_num_seqs=4, max_model_len=128,
                block_size=16, num_gpu_blocks_override=12) as llm:
        assert_vllm_s_defaults(llm)
        served = serve_with_late_arrivals(llm, prompts, NEW_TOKENS)
        preemptions = counter(llm, "vllm:num_preemptions")
        hits = counter(llm, "vllm:prefix_cache_hits")
        served_sharing = serve_in_order(llm, sharing, SHARING_NEW_TOKENS)
        hits = counter(llm, "vllm:prefix_cache_hits") - hits
    assert max(map(len, prompts)) > STEP_TOKENS  # chunked prefill
    assert preemptions > 0, "the KV cache was large enough for every request"
    assert_as_generate(served, expected)
    # the prompts that share a prefix, one after another: the later ones skip the cached blocks, and the memory
    # continues from the look-back vLLM's align mode kept at the block boundary
    assert hits >= 32 * (len(sharing) - 1), f"{hits} tokens came from the prefix cache"
    assert_as_generate(served_sharing, sharing_expected)


def test_speculative_decoding_gives_generate_s_tokens(tmp_path, monkeypatch):
    """vLLM's prompt-lookup (ngram) speculation, 3 drafts a step, over prompts that repeat themselves: some drafts are
    accepted, most are rejected, and every token equals ``generate``'s (a rejected draft that stayed in the memory's
    look-back would change the next ones). On a CPU vLLM verifies drafts only without prefix caching
    (`speculate_without_prefix_caching_on_a_cpu`)."""
    model = save_tiny_model(tmp_path / "model", "factorengram", "before_attn")
    prompts = [prompt * 4 for prompt in random_prompts((6, 9, 4, 12), seed=3)]
    new_tokens = (30, 24, 30, 20)
    expected = [generate_greedy(model, prompt, new) for prompt, new in zip(prompts, new_tokens)]
    speculation = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    traced_without_inductor(monkeypatch)
    with engine(tmp_path / "model", max_num_batched_tokens=64, max_num_seqs=4, max_model_len=160, block_size=16,
                speculative_config=speculation) as llm:
        served = serve_with_late_arrivals(llm, prompts, new_tokens, first=2)
        accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens")
        drafts = counter(llm, "vllm:spec_decode_num_draft_tokens")
    assert 0 < accepted < drafts, f"{accepted} of {drafts} drafts accepted"
    assert_as_generate(served, expected)
