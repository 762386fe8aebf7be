"""`fe_megatron.vllm.request_history`: a memory branch over a server's flat batch of requests equals the
branch run on each request alone, whatever the chunks, the interleaving, the slots and the restarts.

This is the serving adapter's arithmetic without vLLM (tests/serving runs it inside vLLM)."""

import random

import pytest
import torch

from fe_megatron.config import BackboneConfig, MemoryConfig
from fe_megatron.memory import build_memory
from fe_megatron.vllm import request_history
from fe_megatron.vllm.request_history import RequestBatch, state_shapes
from tests.helpers.memory import randomize

BACKBONE = BackboneConfig(vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=2, ffn_hidden_size=64,
                          seq_length=64)
# FactorEngram and Engram with each gate, without unigrams, and a dilated convolution
BRANCHES = {
    "factorengram-basis": dict(kind="factorengram", gate="basis"),
    "factorengram-scalar": dict(kind="factorengram", gate="scalar"),
    "factorengram-none-no-unigram": dict(kind="factorengram", gate="none", ngram_orders=[2, 3],
                                         table_capacity=[300, 300], coeff_width=32),
    "engram-scalar": dict(kind="engram", gate="scalar", memory_dim=48),
    "engram-none-dilated": dict(kind="engram", gate="none", memory_dim=48, conv_dilation=2),
    # nothing to look back on: unigrams only and a one-tap convolution
    "factorengram-unigram-one-tap": dict(kind="factorengram", gate="basis", ngram_orders=[1], table_capacity=[97],
                                         conv_kernel_size=1),
}


def branch_of(name):
    fields = dict(ngram_orders=[1, 2, 3], heads_per_order=2, table_capacity=[97, 300, 300], coeff_width=48,
                  memory_dim=24, layers=[0], conv_kernel_size=4, conv_dilation=1)
    fields.update(BRANCHES[name])
    torch.manual_seed(0)
    return randomize(build_memory(MemoryConfig(backbone=BACKBONE, **fields), 0)).eval()


def serve(branch, requests, steps, num_slots=6):
    """Run ``branch`` as a server would: ``steps`` is a list of steps, each ``[(request, count)]``: the next
    ``count`` tokens of each request, or ``(request, "restart")`` (preempted: it starts over in a new slot).
    Returns each request's outputs, position by position, from its last start."""
    ids_shape, values_shape = state_shapes(branch.config)
    ids_state = torch.randint(0, 97, (num_slots, *ids_shape), dtype=torch.int32)  # stale slots
    values_state = torch.randn(num_slots, *values_shape)
    done = {r: 0 for r in requests}
    slot = {r: i for i, r in enumerate(requests)}
    outputs = {r: [] for r in requests}
    free = list(range(len(requests), num_slots))
    for step in steps:
        lengths, slots, history, ids, hidden, owners = [], [], [], [], [], []
        for request, count in step:
            if count == "restart":
                done[request], outputs[request] = 0, []
                free.append(slot[request])
                slot[request] = free.pop(0)
                continue
            token_ids, states = requests[request]
            lengths.append(count)
            slots.append(slot[request])
            history.append(done[request] > 0)
            ids.append(token_ids[done[request]:done[request] + count])
            hidden.append(states[done[request]:done[request] + count])
            owners.append((request, count))
            done[request] += count
        if not lengths:
            continue
        batch = RequestBatch(torch.tensor(lengths), torch.tensor(slots), torch.tensor(history))
        flat_ids, flat_hidden = torch.cat(ids), torch.cat(hidden)
        with torch.no_grad():
            addresses = request_history.addresses(branch, flat_ids, batch, ids_state)
            rows = branch.lookup(flat_hidden[None], None, branch.start_lookup(addresses[None]))
            out = request_history.refine(branch, branch.values(flat_hidden[None], rows)[0], batch, values_state)
        for (request, count), chunk in zip(owners, out.split(lengths)):
            outputs[request].append(chunk)
    return {r: torch.cat(chunks) for r, chunks in outputs.items()}


@pytest.mark.parametrize("name", sorted(BRANCHES))
def test_a_served_batch_equals_each_request_alone(name):
    """Three requests of 1, 10 and 15 tokens in chunks of every size, decodes beside prefills and steps of decodes
    only, one request preempted and recomputed in another slot, stale values in the slots: every position's
    output equals the branch's forward over that request alone (Eq. 1 and 10 read earlier positions across the
    chunks)."""
    branch = branch_of(name)
    generator = torch.Generator().manual_seed(1)
    requests = {r: (torch.randint(0, 97, (n,), generator=generator), torch.randn(n, 32, generator=generator))
                for r, n in (("a", 1), ("b", 10), ("c", 15))}
    steps = [[("b", 4), ("c", 3)], [("a", 1), ("b", 1), ("c", 5)], [("b", 1), ("c", "restart")],
             [("b", 2), ("c", 6)], [("c", 7), ("b", 1)], [("c", 1)], [("b", 1), ("c", 1)]]
    served = serve(branch, requests, steps)
    for request, (token_ids, states) in requests.items():
        with torch.no_grad():
            alone, _ = branch(states[None], token_ids[None])
        assert served[request].shape == alone[0].shape
        torch.testing.assert_close(served[request], alone[0], rtol=1e-5, atol=1e-5)


def test_the_look_back_matters():
    """A second chunk's outputs differ from the same tokens served as a fresh start: the test above would see
    a lost look-back."""
    branch = branch_of("factorengram-basis")
    token_ids, states = torch.randint(0, 97, (8,)), torch.randn(8, 32)
    kept = serve(branch, {"r": (token_ids, states)}, [[("r", 4)], [("r", 4)]])["r"]
    fresh = serve(branch, {"r": (token_ids[4:], states[4:])}, [[("r", 4)]])["r"]
    assert not torch.allclose(kept[4:], fresh, atol=1e-3)


def test_a_request_without_tokens_is_refused():
    with pytest.raises(ValueError, match=r"at least one new token, got lengths \[2, 0\]"):
        RequestBatch(torch.tensor([2, 0]), torch.tensor([0, 1]), torch.tensor([False, False]))


def test_random_interleavings_match():
    """Random chunkings and orders of four requests (a property check with a fixed seed)."""
    branch = branch_of("engram-scalar")
    rng = random.Random(3)
    generator = torch.Generator().manual_seed(4)
    sizes = {"a": 11, "b": 5, "c": 17, "d": 2}
    requests = {r: (torch.randint(0, 97, (n,), generator=generator), torch.randn(n, 32, generator=generator))
                for r, n in sizes.items()}
    left, steps = dict(sizes), []
    while any(left.values()):
        step = []
        for request in rng.sample(sorted(left), len(left)):
            if left[request] and rng.random() < 0.7:
                count = rng.randint(1, left[request])
                step.append((request, count))
                left[request] -= count
        steps.append(step)
    served = serve(branch, requests, steps)
    for request, (token_ids, states) in requests.items():
        with torch.no_grad():
            alone, _ = branch(states[None], token_ids[None])
        torch.testing.assert_close(served[request], alone[0], rtol=1e-5, atol=1e-5)
