"""Tiny converted models for the serving tests (tests/serving), and transformers' greedy generation as the
reference.

The models are Hugging Face folders as ``fe-convert mcore-to-hf`` writes them (config, safetensors, no
tokenizer: the engine takes token ids), with head size 32 (vLLM's CPU attention runs 32 and 64, not 16)
and memory branches whose output matters from the first token.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from fe_megatron.config import BackboneConfig, MemoryConfig
from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM
from tests.helpers.models import make_memory_matter, with_table_dtype

VOCAB = 256
BACKBONE = BackboneConfig(vocab_size=VOCAB, hidden_size=64, num_layers=3, num_attention_heads=2, num_query_groups=1,
                          ffn_hidden_size=128, seq_length=512)
KINDS = {
    "factorengram": dict(kind="factorengram", gate="basis", memory_dim=32),
    "engram": dict(kind="engram", gate="scalar", memory_dim=48),
}


def save_tiny_model(directory, kind="factorengram", placement="before_attn", table_dtype="fp32", seed=0,
                    layers=(0, 2)) -> FactorEngramForCausalLM:
    """A 3-layer model with memory at ``layers``, saved in ``directory``; returns it (fp32 in memory, tables
    in ``table_dtype``, as ``fe-convert --table-dtype`` writes them)."""
    memory = MemoryConfig(backbone=BACKBONE, ngram_orders=[1, 2, 3], heads_per_order=2,
                          table_capacity=[VOCAB, 1000, 1000], coeff_width=48, layers=list(layers), placement=placement,
                          **KINDS[kind])
    config = FactorEngramConfig.from_fe_megatron(BACKBONE, memory, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    model = FactorEngramForCausalLM(config).eval()
    make_memory_matter(model, 0.3)
    model = with_table_dtype(model, table_dtype)
    model.save_pretrained(directory)
    return model


def without_memory(model: FactorEngramForCausalLM) -> FactorEngramForCausalLM:
    """The same backbone with every memory branch's output zeroed (to show that the memory changes tokens)."""
    plain = FactorEngramForCausalLM(model.config).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, param in plain.named_parameters():
            if ".memory." in name and "value_proj" in name:
                param.zero_()
    return plain


@dataclasses.dataclass
class Greedy:
    tokens: list
    logprobs: list  # of each chosen token


def generate_greedy(model, prompt: list, new_tokens: int) -> Greedy:
    """transformers' ``generate``, greedy, ``new_tokens`` tokens after ``prompt``, with each token's log-prob."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    # the raw logits, as vLLM's log-probs: min_new_tokens masks the end-of-text token in generate's scores
    logprobs = [torch.log_softmax(logits[0].float(), -1)[token].item() for logits, token in zip(out.logits, tokens)]
    return Greedy(tokens, logprobs)


def random_prompts(lengths, seed=1) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in lengths]


SKIP_REASON = "vLLM is not installed here: `make test-serve` runs the serving tests in .venv-serve"


def require_vllm():
    """vLLM, or a skip where it is not installed; under ``FE_REQUIRE_VLLM=1`` (``make test-serve``) an import that
    fails is an error, not a skip, so that a broken serving environment cannot pass as one without vLLM."""
    import os

    import pytest

    if os.environ.get("FE_REQUIRE_VLLM") == "1":
        import vllm

        return vllm
    return pytest.importorskip("vllm", reason=SKIP_REASON)


def engine_settings(**overrides) -> dict:
    """Arguments of `vllm.LLM` for the tiny models on a CPU: float32, token ids in and out, statistics kept (the
    preemption count).  On a CPU vLLM reserves ``gpu_memory_utilization`` of the host's memory for its cache
    (its default, 0.92, is refused on a machine with other work)."""
    settings = dict(dtype="float32", gpu_memory_utilization=0.05, max_model_len=256, skip_tokenizer_init=True,
                    enable_chunked_prefill=True, disable_log_stats=False, seed=0)
    settings.update(overrides)
    return settings


def traced_without_inductor(monkeypatch) -> None:
    """vLLM's CPU CI setting (``VLLM_CPU_CI_ENV=1``): the model is still traced by dynamo around the memory's custom
    ops, but runs on the eager backend, without inductor's 10-25 s of code generation per engine. For tests whose
    subject is not compilation (test_exact_against_generate and test_server run inductor, vLLM's default)."""
    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")


@contextlib.contextmanager
def engine(directory, **overrides):
    """A `vllm.LLM` over ``directory`` with `engine_settings`, shut down at the end of the block (its processes
    gone before the test ends, not at the interpreter's exit)."""
    import vllm

    llm = vllm.LLM(str(directory), **engine_settings(**overrides))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def counter(llm, name: str) -> float:
    """The value of the engine's counter ``name`` (e.g. ``vllm:num_preemptions``), summed over engines."""
    return sum(metric.value for metric in llm.get_metrics() if metric.name == name)


def served_tables(model) -> list:
    """``[(layer, dtype, mapped from the file)]`` of each memory layer's tables in a model vLLM serves (run in its
    workers with ``LLM.apply_model``)."""
    layers = model.model.layers
    return [(index, str(layers[index].memory.branch.tables.weight.dtype),
             bool(getattr(layers[index].memory.branch.tables.holder, "mapped", False)))
            for index in model.model.memory_layers]
