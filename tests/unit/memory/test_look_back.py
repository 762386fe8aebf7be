"""`fe_megatron.memory.look_back`: a memory branch over a server's flat batch of requests equals the branch run on
each request alone, whatever the chunks, the interleaving, the slots, the restarts and the rejected drafts.

This is the serving arithmetic without vLLM (tests/serving runs it inside vLLM); ``generate`` runs it too."""

import random

import pytest
import torch

from fe_megatron.config import BackboneConfig, MemoryConfig
from fe_megatron.memory import build_memory
from fe_megatron.memory import look_back
from fe_megatron.memory.look_back import RequestBatch, ServedStep, state_shapes
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


def serve(branch, requests, steps, num_slots=6, speculative_tokens=0):
    """Run ``branch`` as a server would: ``steps`` is a list of steps, each ``[(request, count)]``: the next
    ``count`` tokens of each request; ``(request, "restart")`` (preempted: it starts over in a new slot); or
    ``(request, drafts, accepted)``: its next token and ``drafts`` draft tokens verified at once, of which the first
    ``accepted - 1`` are its true next tokens and the rest wrong ones (random ids and states), as speculative
    decoding verifies them. Returns each request's outputs at its true positions, from its last start."""
    ids_shape, values_shape = state_shapes(branch.config, speculative_tokens)
    ids_state = torch.randint(0, 97, (num_slots, *ids_shape), dtype=torch.int32)[..., 0]  # stale slots
    values_state = torch.randn(num_slots, *values_shape)
    done = {r: 0 for r in requests}
    slot = {r: i for i, r in enumerate(requests)}
    read_from = {r: 0 for r in requests}  # the last step's accepted drafts
    outputs = {r: [] for r in requests}
    free = list(range(len(requests), num_slots))
    for step in steps:
        lengths, slots, history, offsets, drafting, ids, hidden, owners = [], [], [], [], [], [], [], []
        for request, *what in step:
            if what == ["restart"]:
                done[request], outputs[request], read_from[request] = 0, [], 0
                free.append(slot[request])
                slot[request] = free.pop(0)
                continue
            token_ids, states = requests[request]
            if len(what) == 1:  # a prompt chunk or one decoded token
                count = kept = what[0]
                new_ids, new_states = token_ids[done[request]:done[request] + count], states[done[request]:][:count]
            else:  # the next token and its drafts, ``kept`` of them true
                drafts, kept = what
                count = 1 + drafts
                wrong = count - kept
                new_ids = torch.cat([token_ids[done[request]:done[request] + kept], torch.randint(0, 97, (wrong,))])
                new_states = torch.cat([states[done[request]:done[request] + kept], torch.randn(wrong, 32)])
            lengths.append(count)
            slots.append(slot[request])
            history.append(done[request] > 0)
            offsets.append(read_from[request])
            drafting.append(len(what) == 2)
            ids.append(new_ids)
            hidden.append(new_states)
            owners.append((request, kept))
            done[request] += kept
            read_from[request] = kept - 1 if len(what) == 2 else 0
        if not lengths:
            continue
        batch = RequestBatch.of_lengths(torch.tensor(lengths), torch.tensor(slots), torch.tensor(history))
        if speculative_tokens:
            batch.read_from, batch.speculative = torch.tensor(offsets), torch.tensor(drafting)
        flat_ids, flat_hidden = torch.cat(ids), torch.cat(hidden)
        with torch.no_grad():
            lookup_ids = branch.hasher.lookup_ids(flat_ids[None])[0]
            addresses = look_back.addresses(branch.hasher, lookup_ids, batch, ids_state)
            out, _ = branch(flat_hidden[None], lookup=branch.start_lookup(addresses[None]),
                            decoding=ServedStep(batch, values_state))
        for (request, kept), chunk in zip(owners, out[0].split(lengths)):
            outputs[request].append(chunk[:kept])
    return {r: torch.cat(chunks) for r, chunks in outputs.items()}


def assert_each_request_alone(branch, requests, served):
    for request, (token_ids, states) in requests.items():
        with torch.no_grad():
            alone, _ = branch(states[None], token_ids[None])
        assert served[request].shape == alone[0].shape
        torch.testing.assert_close(served[request], alone[0], rtol=1e-5, atol=1e-5)


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
    assert_each_request_alone(branch, requests, serve(branch, requests, steps))


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
        RequestBatch.of_lengths(torch.tensor([2, 0]), torch.tensor([0, 1]), torch.tensor([False, False]))


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
    assert_each_request_alone(branch, requests, serve(branch, requests, steps))


@pytest.mark.parametrize("name", ["factorengram-basis", "engram-none-dilated", "factorengram-unigram-one-tap"])
def test_rejected_drafts_leave_the_look_back_as_if_never_proposed(name):
    """Speculative decoding: steps that verify a request's next token with up to 3 drafts, some accepted, some all
    rejected, beside prefills, plain decodes and a restart: every true position's output equals the branch over
    the request alone (the next step reads the look-back at the accepted draft)."""
    branch = branch_of(name)
    generator = torch.Generator().manual_seed(5)
    requests = {r: (torch.randint(0, 97, (n,), generator=generator), torch.randn(n, 32, generator=generator))
                for r, n in (("a", 24), ("b", 20), ("c", 16))}
    steps = [[("a", 5), ("b", 3)], [("a", 3, 2), ("b", 4), ("c", 2)], [("a", 3, 1), ("b", 2, 3), ("c", 1)],
             [("a", 3, 4), ("b", 3, 1), ("c", 3, 4)], [("a", 1), ("b", 3, 2), ("c", "restart")],
             [("a", 2, 3), ("c", 4)], [("a", 3, 1), ("b", 1), ("c", 3, 2)], [("b", 3, 2), ("c", 3, 3)]]
    served = serve(branch, requests, steps, speculative_tokens=3)
    truncated = {r: (token_ids[:len(served[r])], states[:len(served[r])]) for r, (token_ids, states) in requests.items()}
    assert all(len(served[r]) > 6 for r in requests)
    assert_each_request_alone(branch, truncated, served)


def test_the_batch_of_generate_equals_the_full_forward():
    """``generate``'s layout (`RequestBatch.rows`: B sequences, T new tokens each, in the same slots): a prompt of 7
    then steps of 1 and 3 tokens give the full forward's outputs."""
    branch = branch_of("factorengram-basis")
    token_ids, states = torch.randint(0, 97, (2, 11)), torch.randn(2, 11, 32)
    ids_state = torch.full((2, branch.config.max_order - 1), branch.hasher.pad_id)
    values_state = torch.zeros(2, branch.conv.receptive_field, branch.config.output_size)
    outputs = []
    with torch.no_grad():
        for start, end in ((0, 7), (7, 8), (8, 11)):
            batch = RequestBatch.rows(2, end - start, "cpu")
            lookup_ids = branch.hasher.lookup_ids(token_ids[:, start:end]).flatten()
            addresses = look_back.addresses(branch.hasher, lookup_ids, batch, ids_state).view(2, end - start, -1)
            out, _ = branch(states[:, start:end], lookup=branch.start_lookup(addresses),
                            decoding=ServedStep(batch, values_state))
            outputs.append(out)
        full, _ = branch(states, token_ids)
    torch.testing.assert_close(torch.cat(outputs, 1), full, rtol=1e-5, atol=1e-5)
