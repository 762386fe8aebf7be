"""``vllm serve <converted folder>``, as a newcomer types it: the OpenAI-compatible server answers
``/v1/completions`` and ``/v1/chat/completions`` with ``generate``'s tokens.

The folder is laid out as ``fe-convert mcore-to-hf`` writes it, with its sentencepiece tokenizer and the plain chat
template in it (`fe_megatron/hf/plain_chat_template.jinja`), so chat needs no ``--chat-template``; the command is
the ``vllm`` of the environment (``make setup-serve`` installs one that runs on vLLM's CPU build), at vLLM's
default ``--gpu-memory-utilization``, whose reservation of the host's memory the plugin caps on a CPU.  The server
listens on 127.0.0.1 only and is stopped at the end.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from tests.helpers.models import make_memory_matter
from tests.helpers.serving import generate_greedy, require_vllm
from tests.helpers.tokenizers import train_fe_data_tokenizer

vllm = require_vllm()

def converted_folder(base):
    """A 3-layer FactorEngram model with memory at layers 0 and 2 and the run's tokenizer, as fe-convert writes it."""
    from fe_megatron.config import BackboneConfig, MemoryConfig
    from fe_megatron.hf import AUTO_MAP, FactorEngramConfig, FactorEngramForCausalLM, save_tokenizer

    directory = str(base / "hf")
    tokenizer = save_tokenizer(train_fe_data_tokenizer(str(base), vocab_size=600, documents=20), directory)
    backbone = BackboneConfig(vocab_size=len(tokenizer), hidden_size=64, num_layers=3, num_attention_heads=2,
                              ffn_hidden_size=128, seq_length=256)
    memory = MemoryConfig(backbone=backbone, ngram_orders=[1, 2, 3], heads_per_order=2,
                          table_capacity=[len(tokenizer), 997, 997], coeff_width=48, memory_dim=32, layers=[0, 2])
    config = FactorEngramConfig.from_fe_megatron(
        backbone, memory, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, architectures=["FactorEngramForCausalLM"], auto_map=AUTO_MAP)
    torch.manual_seed(0)
    model = FactorEngramForCausalLM(config).eval()
    make_memory_matter(model, 0.3)
    model.save_pretrained(directory)
    return directory, model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(port, path, body) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def wait_until_ready(server, port, log, deadline=300):
    start = time.time()
    while time.time() - start < deadline:
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"vllm serve did not answer /health within {deadline} s:\n{log.read_text()[-4000:]}")


def serve_command(directory) -> list:
    """``vllm serve <folder>``, the environment's own command."""
    return [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", directory]


def test_vllm_serve_answers_completions_and_chat_with_generates_tokens(tmp_path):
    directory, model = converted_folder(tmp_path)
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [*serve_command(directory), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--max-model-len", "256", "--served-model-name", "tiny"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(server, port, log)
        # vLLM's default --gpu-memory-utilization (0.92 of the host's memory on a CPU), capped by the plugin
        assert "which this FactorEngram model takes instead (--kv-cache-memory-bytes sets it)" in log.read_text()
        text = "The state of the union is"
        completion = post(port, "/v1/completions", dict(model="tiny", prompt=text, max_tokens=12, min_tokens=12,
                                                          temperature=0.0, ignore_eos=True, return_token_ids=True))
        choice = completion["choices"][0]
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
        assert choice["prompt_token_ids"] == tokenizer(text)["input_ids"]
        assert choice["token_ids"] == generate_greedy(model, choice["prompt_token_ids"], 12).tokens

        messages = [{"role": "user", "content": "What did the president say?"}]
        chat = post(port, "/v1/chat/completions", dict(model="tiny", messages=messages, max_tokens=10,
                                                          min_tokens=10, temperature=0.0, ignore_eos=True,
                                                          return_token_ids=True))
        prompt_ids = chat["prompt_token_ids"]
        assert tokenizer.decode(prompt_ids, skip_special_tokens=True).endswith("Assistant:")
        assert chat["choices"][0]["token_ids"] == generate_greedy(model, prompt_ids, 10).tokens
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
