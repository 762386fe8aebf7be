"""The Hugging Face model (`fe_megatron.hf.modeling_fe_megatron`): torch.compile through the memory
branch, initialization, cached generation, the decoding step's lookback, the loss, and gradient
checkpointing. Loading through transformers' Auto classes and remote code, in a fresh interpreter, is
tests/integration/test_hf_loading.py's."""

import pytest
import torch

from tests.helpers.models import tiny_model


def test_torch_compile_runs_through_the_memory_branch_without_graph_breaks():
    """The hash and the row gather are torch.library operators with fake implementations and an
    autograd formula: torch.compile captures a training forward of the model as one graph (there
    were 25 graph breaks in this model before), and the compiled loss and every gradient, the
    tables' included, equal eager's."""
    import torch._dynamo as dynamo

    model = tiny_model().train()
    ids = torch.randint(3, 256, (2, 32))
    explain = dynamo.explain(lambda batch: model(input_ids=batch, labels=batch).loss)(ids)
    assert explain.graph_break_count == 0, [str(reason.reason)[:200] for reason in explain.break_reasons]
    dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    compiled_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    eager = model(input_ids=ids, labels=ids).loss
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-6, atol=1e-6)
    assert any(".memory.tables" in name for name in compiled_grads)
    for name, param in model.named_parameters():
        assert torch.allclose(compiled_grads[name], param.grad, rtol=1e-5, atol=1e-6), name
    dynamo.reset()


@pytest.mark.parametrize("kind", ["factorengram", "engram"])
def test_a_model_from_its_config_initializes_every_memory_parameter(kind):
    """Engram's branch has no direct parameters; transformers must not skip it as initialized."""
    for _ in range(2):  # uninitialized memory could pass once by chance
        memory = tiny_model(kind, perturb=False).model.layers[0].memory
        tables, values = memory.tables.weight, memory.value_proj.weight
        assert torch.isfinite(tables).all() and abs(tables.std().item() - memory.config.table_init_std) < 0.1
        assert torch.count_nonzero(values) == 0 and torch.count_nonzero(memory.conv.weight) == 0
        key = memory.key_proj.weight if kind == "engram" else memory.query_proj.weight
        assert abs(key.std().item() - memory.config.init_std) < 0.005


@pytest.mark.parametrize("kind", ["factorengram", "engram"])
@pytest.mark.parametrize("placement", ["before_attn", "before_ffn", "inside_ffn"])
def test_cached_greedy_generation_equals_full_recompute(kind, placement):
    model = tiny_model(kind, placement)
    ids = torch.randint(3, 256, (3, 12))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0  # left padding
    ids[1, :2], mask[1, :2] = 0, 0
    settings = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, attention_mask=mask, use_cache=True, **settings)
    recomputed = model.generate(ids, attention_mask=mask, use_cache=False, **settings)
    assert cached.shape == (3, 12 + 64) and torch.equal(cached, recomputed)
    single = model.generate(ids[2:], use_cache=True, **settings)
    assert torch.equal(single, model.generate(ids[2:], use_cache=False, **settings))
    # padding is "before the sequence start": a padded row generates what it generates alone
    alone = model.generate(ids[0:1, 5:], use_cache=True, **settings)
    assert torch.equal(cached[0, 12:], alone[0, 7:])
    assert torch.equal(cached[2:], single)


def test_a_decoding_step_reads_a_fixed_lookback_only():
    """The memory state stays [batch, max_order - 1] ids and [batch, (K-1) r, d] values."""
    from fe_megatron.hf import FactorEngramCache

    model = tiny_model()
    cache = FactorEngramCache(config=model.config)
    out = model(torch.randint(3, 256, (2, 40)), past_key_values=cache, use_cache=True)
    for _ in range(3):
        out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    for layer, state in cache.memory_states.items():
        branch = model.model.layers[layer].memory
        assert state.recent_ids.shape == (2, 2)
        assert state.recent_values.shape == (2, branch.conv.receptive_field, 64)


def test_the_loss_is_eq_13():
    model = tiny_model()
    ids = torch.randint(3, 256, (2, 16))
    out = model(ids, labels=ids)
    lm = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    # Eq. 12 by hand: ||z_t||_1 averaged over positions, then over the insertion layers
    terms = []
    for index in model.config.memory["layers"]:
        layer = model.model.layers[index]
        layer.memory.register_forward_hook(lambda module, args, out: terms.append(out[1].mean()))
    sparsity = model.model(ids).sparsity_loss
    assert len(terms) == 2 and torch.allclose(sparsity, torch.stack(terms).mean()) and sparsity > 0
    assert torch.allclose(out.loss, lm + model.config.memory["sparsity_lambda"] * sparsity, atol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("placement", ["before_attn", "inside_ffn"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(placement, reentrant):
    """Under transformers' gradient checkpointing each memory layer runs twice; the model's memory inputs then
    hold the addresses, and each run starts its own lookup (`fe_megatron.memory.inputs`). A reentrant
    checkpoint runs the first pass without autograd: the sparsity term still gets its gradient (the layer
    returns it), so the tables' gradients are the same as without checkpointing."""
    torch.manual_seed(3)
    ids = torch.randint(3, 256, (2, 16))
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(4)
        model = tiny_model(placement=placement)
        model.train()
        if checkpointing:  # transformers 5.24 renamed it; older releases have only the first name
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            assert model.model.gradient_checkpointing
        # the config's use_cache=True is dropped under checkpointing; the reference runs without a cache too
        loss = model(ids, labels=ids, **({} if checkpointing else {"use_cache": False})).loss
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                                        if p.grad is not None}))
    (loss, grads), (loss_checkpointed, grads_checkpointed) = results
    torch.testing.assert_close(loss_checkpointed, loss, rtol=0, atol=0)
    assert any(".memory.tables." in name for name in grads) and grads.keys() == grads_checkpointed.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_checkpointed[name], grad, rtol=0, atol=0, msg=name)


def test_lookups_started_ahead_give_the_model_s_own_logits_and_old_keywords_are_refused():
    """`start_memory_lookups` for the same ids, passed as ``memory_inputs`` (the DeepSpeed engine's host tier),
    gives the logits the model computes itself; lookups of other ids change them (they are read, not dropped).
    ``memory_lookups=`` (the keyword before `MemoryInputs`), a dict for ``memory_inputs``, and given inputs
    beside a cache (whose positions the model hashes itself) are refused by name."""
    from fe_megatron.memory.inputs import MemoryInputs

    model = tiny_model()
    ids, other = torch.randint(3, 256, (2, 9)), torch.randint(3, 256, (2, 9))
    expected = model(ids, use_cache=False).logits
    ahead = model.start_memory_lookups(ids, ids.device)
    assert isinstance(ahead, MemoryInputs) and sorted(ahead.lookups) == [0, 2]
    torch.testing.assert_close(model(ids, use_cache=False, memory_inputs=ahead).logits, expected, rtol=0, atol=0)
    assert not torch.equal(model(ids, use_cache=False,
                                 memory_inputs=model.start_memory_lookups(other, ids.device)).logits, expected)
    with pytest.raises(TypeError, match=r"memory_lookups= is now memory_inputs="):
        model(ids, use_cache=False, memory_lookups=ahead.lookups)
    with pytest.raises(TypeError, match="memory_inputs must be a fe_megatron.memory.inputs.MemoryInputs, got a dict"):
        model(ids, use_cache=False, memory_inputs=dict(ahead.lookups))
    addresses = {index: model.model.layers[index].memory.addresses(ids) for index in (0, 2)}
    with pytest.raises(ValueError, match="cannot be used with padding or a cache"):
        model(ids, use_cache=True, memory_inputs=MemoryInputs(addresses=addresses))
