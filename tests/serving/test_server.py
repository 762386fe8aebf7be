"""``vllm serve <converted folder>``, as a newcomer types it: the OpenAI-compatible server answers
``/v1/completions`` and ``/v1/chat/completions`` with ``generate``'s tokens, under the load of many clients at once,
and bad requests with a 400 that names the problem.

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
MAX_MODEL_LEN = 256

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``vllm serve`` over a converted folder on 127.0.0.1, at vLLM's defaults but the dtype (float32, as trained)
    and inductor (traced by dynamo, run on the eager backend: vLLM's CPU CI setting, ``VLLM_CPU_CI_ENV=1``;
    test_exact_against_generate runs inductor): ``(port, folder, the model, the server's log)``; stopped at the end
    of the module."""
    base = tmp_path_factory.mktemp("served")
    directory, model = converted_folder(base)
    port = free_port()
    log = base / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [*serve_command(directory), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny"], stdout=out,
            stderr=subprocess.STDOUT, env=dict(os.environ, VLLM_CPU_CI_ENV="1"))
    try:
        wait_until_ready(process, port, log)
        yield port, directory, model, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_vllm_serve_answers_completions_and_chat_with_generates_tokens(server):
    port, directory, model, log = server
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


def complete(port, body) -> list:
    """The completion's token ids, streamed or not."""
    if not body.get("stream"):
        return post(port, "/v1/completions", body)["choices"][0]["token_ids"]
    tokens = []
    for chunk in stream(port, body):
        tokens += chunk["choices"][0]["token_ids"] or []
    return tokens


def stream(port, body):
    """The chunks of a streamed completion, as they arrive (closing the generator closes the connection)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200, response.read().decode()
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: "):])
    finally:
        connection.close()


def metric(port, name, label="") -> float:
    """The server's counter or gauge ``name`` (summed over its series), of the series with ``label`` if given."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(name) and line[len(name)] in "{ " and label in line)


def test_the_server_under_load_loses_and_changes_no_answer(server):
    """36 clients at once on 127.0.0.1: prompts of 2 to 80 tokens, 4 to 24 new ones, half of them streamed, 6 streams
    of 100 to 120 tokens closed after their second chunk. Every completed answer equals ``generate``'s, none is lost, and the closed
    streams leave no request running."""
    import random
    import threading

    port, _, model, _ = server
    rng = random.Random(11)
    vocab = model.config.vocab_size
    clients = [dict(prompt=[rng.randrange(3, vocab) for _ in range(rng.randint(2, 80))],
                    max_tokens=rng.randint(100, 120) if index % 6 == 1 else rng.randint(4, 24),
                    stream=index % 2 == 1, cancel=index % 6 == 1) for index in range(36)]
    expected = [None if client["cancel"] else generate_greedy(model, client["prompt"], client["max_tokens"]).tokens
                for client in clients]
    generated = metric(port, "vllm:generation_tokens_total")
    answers, errors = {}, []

    def run(index, client):
        body = dict(model="tiny", prompt=client["prompt"], max_tokens=client["max_tokens"],
                    min_tokens=client["max_tokens"], temperature=0.0, ignore_eos=True, return_token_ids=True,
                    stream=client["stream"])
        try:
            if client["cancel"]:
                chunks = stream(port, body)
                for _ in range(2):
                    next(chunks)
                chunks.close()
                answers[index] = "cancelled"
            else:
                answers[index] = complete(port, body)
        except Exception as error:  # noqa: BLE001 - reported below, by client
            errors.append(f"client {index}: {error!r}")

    threads = [threading.Thread(target=run, args=(index, client)) for index, client in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and not any(thread.is_alive() for thread in threads), errors
    for index, client in enumerate(clients):
        if client["cancel"]:
            assert answers[index] == "cancelled"
        else:
            assert answers[index] == expected[index], f"client {index} ({len(client['prompt'])} tokens)"
    deadline = time.time() + 60
    while metric(port, "vllm:num_requests_running") + metric(port, "vllm:num_requests_waiting") and \
            time.time() < deadline:
        time.sleep(0.5)
    assert metric(port, "vllm:num_requests_running") == 0 and metric(port, "vllm:num_requests_waiting") == 0
    # the closed streams stopped where they were closed: fewer tokens generated than they asked for
    by_the_closed = metric(port, "vllm:generation_tokens_total") - generated - sum(map(len, filter(None, expected)))
    asked_by_the_closed = sum(client["max_tokens"] for client in clients if client["cancel"])
    assert 2 * 6 <= by_the_closed < asked_by_the_closed


BAD_REQUESTS = [  # (what is wrong, the request's change, what the 400 says): vLLM refuses each itself
    ("a token id past the vocabulary", dict(prompt=[5, 603]), "Token id 603 is out of vocabulary"),
    ("a negative token id", dict(prompt=[5, -1]), "'loc': 'body.prompt.1', 'msg': 'Input should be greater than or "
                                                  "equal to 0'"),
    ("an empty prompt", dict(prompt=[]), "You must pass at least one prompt"),
    ("an empty text", dict(prompt=""), "Either prompt or prompt_embeds must be provided and non-empty"),
    ("a prompt past max_model_len", dict(prompt=[5] * 300),
     f"maximum context length is {MAX_MODEL_LEN} tokens. However, your prompt contains 300 input tokens"),
    ("max_tokens past max_model_len", dict(max_tokens=1000),
     f"max_tokens=1000 cannot be greater than max_model_len={MAX_MODEL_LEN}"),
    ("more log-probs than allowed", dict(logprobs=50), "Requested sample logprobs of 50, which is greater than max "
                                                       "allowed: 20"),
]


def test_bad_requests_get_a_400_that_names_the_problem_and_the_next_request_is_exact(server):
    import urllib.error

    port, _, model, _ = server
    good = dict(model="tiny", prompt=[5, 6, 7, 8], max_tokens=6, min_tokens=6, temperature=0.0, ignore_eos=True,
                return_token_ids=True)
    for what, change, named in BAD_REQUESTS:
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(port, "/v1/completions", {**good, **change})
        message = json.load(refused.value)["error"]["message"]
        assert refused.value.code == 400 and named in message, f"{what}: {refused.value.code} {message}"
        assert complete(port, good) == generate_greedy(model, good["prompt"], 6).tokens, f"after {what}"
