"""Documents packed into one sequence (`fe_megatron.megatron.batch`, `fe_megatron.ngram.hashing`): with their
position ids restarting at each document, as fe-pretrain's ``data.reset_position_ids`` and Megatron-LM's
``--reset-position-ids`` give them, no n-gram spans two documents. The same documents get the same addresses
through fe-pretrain's data and the forward both Megatron trainers run, through Megatron-LM's ``get_batch`` (the
drop-in), and through the Hugging Face model."""

import argparse

import pytest
import torch

from fe_megatron.config import MemoryConfig
from tests.helpers.configs import tiny_memory_config
from tests.helpers.megatron import build

pytestmark = pytest.mark.usefixtures("megatron_world")

SEQ = 32


def packed(seed: int = 0):
    """Two rows of documents laid end to end, ``(tokens [2, SEQ], position_ids [2, SEQ], documents per row)``."""
    generator = torch.Generator().manual_seed(seed)
    rows = [[9, 1, 14, 5, 3], [4, 12, 2, 11, 3]]
    documents = [[torch.randint(0, 128, (n,), generator=generator) for n in row] for row in rows]
    tokens = torch.stack([torch.cat(row) for row in documents])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in documents])
    return tokens, positions, documents


def alone(memory: MemoryConfig, documents) -> dict:
    """``{layer: [b, s, branches]}``: each document hashed on its own, laid end to end as in its row."""
    from fe_megatron.ngram import NgramHasher

    hashers = {layer: NgramHasher(memory, layer) for layer in memory.layers}
    return {layer: torch.stack([torch.cat([hasher.indices(d.unsqueeze(0))[0] for d in row]) for row in documents])
            for layer, hasher in hashers.items()}


def looked_up(monkeypatch, run) -> dict:
    """``{layer: [b, s, branches]}``: the addresses every memory branch looks up while ``run()`` runs (in its
    branch's sequence layout: Megatron's layers are sequence-first)."""
    from fe_megatron.memory.branch import MemoryBranch

    seen, start = {}, MemoryBranch.start_lookup

    def recording(branch, addresses, device=None):
        seen[branch.layer_index] = (addresses.transpose(0, 1) if branch.parallel.sequence_dim == 0 else addresses)
        return start(branch, addresses, device)

    monkeypatch.setattr(MemoryBranch, "start_lookup", recording)
    run()
    return seen


def megatron_microbatch(tokens, positions):
    from fe_megatron.megatron.batch import Microbatch
    from fe_megatron.megatron.step import causal_mask

    return Microbatch(tokens, tokens, torch.ones(tokens.shape, dtype=torch.float), causal_mask(SEQ), positions)


def test_the_megatron_forward_and_the_hugging_face_model_hash_each_document_alone(monkeypatch):
    from fe_megatron.hf import FactorEngramConfig, FactorEngramForCausalLM
    from fe_megatron.megatron.batch import forward_microbatch

    memory = tiny_memory_config()
    tokens, positions, documents = packed()
    expected = alone(memory, documents)
    model = build(memory)
    megatron = looked_up(monkeypatch, lambda: forward_microbatch(model, megatron_microbatch(tokens, positions)))
    hf_model = FactorEngramForCausalLM(FactorEngramConfig.from_fe_megatron(memory.backbone, memory)).eval()
    with torch.no_grad():
        hf = looked_up(monkeypatch, lambda: hf_model(input_ids=tokens, position_ids=positions, use_cache=False))
    for layer in memory.layers:
        assert torch.equal(megatron[layer], expected[layer]) and torch.equal(hf[layer], expected[layer]), layer
    # without the restarts, the n-grams after each document's first token read the document before it
    counting = torch.arange(SEQ).expand(2, SEQ)
    across = looked_up(monkeypatch, lambda: forward_microbatch(model, megatron_microbatch(tokens, counting)))
    assert not torch.equal(across[memory.layers[0]], expected[memory.layers[0]])


def test_fe_pretrain_s_packed_samples_restart_positions_and_attention_at_each_document(small_data, tmp_path):
    """``data.reset_position_ids`` and ``data.reset_attention_mask``: a sample's position ids restart after each
    end-of-document token, and its attention mask (True = masked, as Megatron's) keeps each token in its own
    document; the batch carries the samples' masks."""
    from fe_megatron.data.datasets import build_datasets, microbatches
    from fe_megatron.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(small_data["tokenizer"])
    train, _, _ = build_datasets([small_data["prefix"]], tokenizer, 256, "100,0,0", [8, 0, 0], 1234, str(tmp_path),
                                 reset_position_ids=True, reset_attention_mask=True)
    batch = microbatches(train, 0, 1, 4, attention_mask=None)[0]
    tokens, positions, mask = batch["tokens"], batch["position_ids"], batch["attention_mask"]
    assert mask.shape == (4, 1, 256, 256) and mask.dtype == torch.bool
    ends = (tokens == tokenizer.eod).nonzero().tolist()
    assert ends, "the samples hold no end of a document"
    for row, end in ends:
        if end + 1 < 256:
            assert positions[row, end + 1] == 0  # the next document starts at position 0
            assert mask[row, 0, end + 1, :end + 1].all()  # and sees nothing of the one before
    document = torch.cumsum(positions == 0, dim=1)
    same = document.unsqueeze(2) == document.unsqueeze(1)
    causal = torch.ones(256, 256, dtype=torch.bool).tril()
    assert torch.equal(~mask[:, 0], same & causal)


def test_megatron_lm_s_batch_carries_the_position_ids_to_the_forward_and_the_context_parallel_hash(monkeypatch):
    """The drop-in's ``get_batch`` hands Megatron-LM's position ids to the forward (``--reset-position-ids`` restarts
    them in Megatron-LM's dataset), and under context parallelism hashes the full sequence within its documents
    before the split."""
    pytest.importorskip("megatron.training", reason="Megatron-LM's trainer is in megatron-core 0.19 on: "
                                                    "`make test-newest` runs this test")
    from megatron.training import global_vars

    from fe_megatron.megatron.batch import forward_microbatch
    from fe_megatron.megatron.hasher import MicrobatchHasher, hash_then_split_for_context_parallel
    from fe_megatron.megatron.step import causal_mask
    from fe_megatron.megatron_lm.batch import get_batch

    memory = tiny_memory_config()
    tokens, positions, documents = packed(1)
    expected = alone(memory, documents)
    sample = dict(tokens=tokens, labels=tokens, loss_mask=torch.ones(tokens.shape), position_ids=positions,
                  attention_mask=causal_mask(SEQ).expand(2, 1, SEQ, SEQ))
    args = argparse.Namespace(create_attention_mask_in_dataloader=True, context_parallel_size=1, micro_batch_size=2,
                              seq_length=SEQ, pipeline_model_parallel_size=1)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    model = build(memory)
    batch = get_batch(iter([sample]), hasher=model.hasher)
    assert torch.equal(batch.position_ids, positions)
    seen = looked_up(monkeypatch, lambda: forward_microbatch(model, batch))
    assert all(torch.equal(seen[layer], expected[layer]) for layer in memory.layers)
    split = hash_then_split_for_context_parallel(MicrobatchHasher(memory), tokens, 2, 1, positions)
    keep = torch.cat([torch.arange(8, 16), torch.arange(16, 24)])  # rank 1 of 2: chunks 1 and 2 of 4
    for layer in memory.layers:
        assert torch.equal(split[layer], expected[layer][:, keep].transpose(0, 1))
