"""vLLM serves a converted FactorEngram (or Engram) model token for token as transformers' ``generate``.

One engine per model, with a step budget of 32 tokens (a 90-token prompt is prefilled in three chunks, so the
n-gram ids and the convolution's values must cross each split), at most 4 running requests (the others wait
and join while earlier ones decode), requests added while others decode, and a KV cache of 12 blocks of 16
tokens, too small for four long requests at once, so vLLM preempts and recomputes some.  Greedy tokens must
equal ``generate``'s and their log-probs agree to 1e-4; the memory changes the tokens, so a lost look-back
would show.
"""

import pytest

from tests.helpers.serving import (counter, engine, generate_greedy, random_prompts, require_vllm,
                                   save_tiny_model, without_memory)

vllm = require_vllm()

PROMPT_LENGTHS = (5, 9, 90, 17, 40, 3, 70, 12, 25, 2)
NEW_TOKENS = (24, 16, 20, 30, 12, 40, 18, 24, 8, 30)
STEP_TOKENS = 32


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

    # prefix caching asked for, as vLLM's default does: the served model turns it off (docs/serving.md)
    with engine(tmp_path / "model", max_num_batched_tokens=STEP_TOKENS, max_num_seqs=4, max_model_len=160,
                block_size=16, num_gpu_blocks_override=12, enable_prefix_caching=True) as llm:
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
        served = serve_with_late_arrivals(llm, prompts, NEW_TOKENS)
        preemptions = counter(llm, "vllm:num_preemptions")
    assert max(map(len, prompts)) > STEP_TOKENS  # chunked prefill
    assert preemptions > 0, "the KV cache was large enough for every request"
    for index, reference in enumerate(expected):
        tokens, logprobs = served[index]
        assert tokens == reference.tokens, f"prompt {index} ({len(prompts[index])} tokens)"
        assert logprobs == pytest.approx(reference.logprobs, abs=1e-4), f"prompt {index}"
