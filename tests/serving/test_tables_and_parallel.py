"""Serving formats of the tables and vLLM's tensor parallelism.

* fp8 tables (``fe-convert --table-dtype fp8``), memory-mapped from the safetensors file
  (``hf_overrides={"table_storage": "mmap"}``), against ``generate`` on the same folder;
* the memory inside the FFN (``inside_ffn``: each tensor-parallel rank adds its slice of ``m`` to its slice of
  the up projection), with vLLM's backbone split over two tensor-parallel ranks.
"""

import pytest

from tests.helpers.serving import (engine, generate_greedy, random_prompts, require_vllm, save_tiny_model,
                                   served_tables, traced_without_inductor)

vllm = require_vllm()


def served_greedy(llm, prompts, new_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [step[token].logprob for step, token in
                                            zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outputs]


def test_fp8_tables_mapped_from_the_file_inside_the_ffn_over_two_tensor_parallel_ranks(tmp_path, monkeypatch):
    # vLLM's CPU workers bind their threads one NUMA node each, or cores given by hand: one core per rank
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # LLM.apply_model sends a function to the workers
    traced_without_inductor(monkeypatch)
    model = save_tiny_model(tmp_path / "model", "factorengram", "inside_ffn", table_dtype="fp8")
    prompts = random_prompts((7, 33, 12, 50, 4, 21, 16, 9), seed=5)
    expected = [generate_greedy(model, prompt, 16) for prompt in prompts]
    with engine(tmp_path / "model", tensor_parallel_size=2, hf_overrides={"table_storage": "mmap"},
                max_num_batched_tokens=32) as llm:
        tables = llm.apply_model(served_tables)
        served = served_greedy(llm, prompts, 16)
    assert tables == [[(0, "torch.float8_e4m3fn", True), (2, "torch.float8_e4m3fn", True)]] * 2  # both ranks
    for index, ((tokens, logprobs), reference) in enumerate(zip(served, expected)):
        assert tokens == reference.tokens, f"prompt {index}"
        assert logprobs == pytest.approx(reference.logprobs, abs=1e-4), f"prompt {index}"


def test_bf16_serving_follows_the_model_in_bf16(tmp_path, capfd, caplog):
    """In bf16 vLLM's kernels and transformers' round differently, so long greedy generations may part. What must
    hold: every token vLLM chooses, its look-back in bf16 state included, is within rounding of the best under
    transformers' bf16 forward of the same sequence, with the log-prob vLLM reports. The float32 folder served in
    bf16 is said once, not in a warning per memory weight."""
    import torch

    model = save_tiny_model(tmp_path / "model", "factorengram", "before_attn", table_dtype="fp8").to(torch.bfloat16)
    prompts = random_prompts((6, 40, 13, 3), seed=7)
    # eager, as a user may still choose (vLLM's compiled default is tested in test_exact_against_generate)
    with engine(tmp_path / "model", dtype="bfloat16", max_num_batched_tokens=16, enforce_eager=True) as llm:
        served = served_greedy(llm, prompts, 12)
    assert "Attempted to load weight" not in "".join(capfd.readouterr())  # the workers' warnings, one per weight
    said = [record for record in caplog.records if record.getMessage() == "this folder's weights are float32 and are "
            "served in bfloat16 (--dtype); --dtype float32 serves them as saved"]
    assert len(said) == 1
    for index, (prompt, (tokens, logprobs)) in enumerate(zip(prompts, served)):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits, -1)
        chosen = expected[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert (expected.max(-1).values - chosen).max() < 0.1, f"prompt {index}: a token far from the best"
        assert logprobs == pytest.approx(chosen.tolist(), abs=0.1), f"prompt {index}"
