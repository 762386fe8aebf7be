"""`fe_megatron.megatron.hybrid_model`: the memory in megatron-core's HybridModel. A pattern of ``*-``
pairs with the memory before the attention of the chosen blocks is the GPT model with memory: with the
same weights, the same logits, sparsity term and gradients, and the same losses over a few optimizer
steps. The memory's inputs are the model's, per forward; what it cannot run beside is refused by name."""

import pytest
import torch

from fe_megatron.megatron import compat

pytestmark = pytest.mark.skipif(not compat.has_hybrid_model(), reason=(
    f"megatron-core {compat.megatron_core_version()} has no HybridModel ({compat.HYBRID_MINIMUM} on); "
    "`make test-newest` runs these tests"))

PATTERN = "*-*-*-"


def hybrid_with_memory(memory_config, pattern=PATTERN, **overrides):
    from fe_megatron.megatron.hybrid_model import FactorEngramHybridModel
    from fe_megatron.megatron.hybrid_specs import local_hybrid_stack_spec
    from tests.helpers.configs import tiny_transformer_config

    return FactorEngramHybridModel(tiny_transformer_config(num_layers=len(pattern.replace("|", "")), **overrides),
                                   local_hybrid_stack_spec(), 128, 32, pattern, memory_config,
                                   position_embedding_type="rope", share_embeddings_and_output_weights=True)


def test_a_pattern_of_pairs_with_memory_is_the_gpt_model_with_memory(megatron_world):
    from fe_megatron.hybrid_pattern import gpt_name_of
    from tests.helpers.configs import tiny_memory_config
    from tests.helpers.megatron import batches, build

    torch.manual_seed(5)
    memory = tiny_memory_config(num_layers=3, layers=[0, 2])
    gpt, hybrid = build(memory, num_layers=3), hybrid_with_memory(memory)
    assert [layer.layer_number - 1 for layer in hybrid.stage_memory_layers] == [0, 4]  # blocks 0, 2: layers 0, 4
    gpt_params = dict(gpt.named_parameters())
    names = {name: gpt_name_of(name, PATTERN) for name, _ in hybrid.named_parameters()}
    assert sorted(names.values()) == sorted(gpt_params)
    with torch.no_grad():
        for name, param in hybrid.named_parameters():
            param.copy_(gpt_params[names[name]] + 0.01 * torch.randn_like(param))  # off the initialization
            gpt_params[names[name]].copy_(param)

    optimizers = [torch.optim.SGD(model.parameters(), lr=0.5) for model in (gpt, hybrid)]
    for step, batch in enumerate(batches(3)):
        losses, logits = [], []
        for model, optimizer in zip((gpt, hybrid), optimizers):
            optimizer.zero_grad()
            out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
            loss = (out * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            loss.backward()
            losses.append(loss.item())
            logits.append(model.pop_sparsity_loss())
        assert abs(losses[0] - losses[1]) < 1e-6, (step, losses)
        assert abs(float(logits[0]) - float(logits[1])) < 1e-7 and float(logits[0]) > 0, (step, logits)
        if step == 0:
            for name, param in hybrid.named_parameters():
                assert (param.grad - gpt_params[names[name]].grad).abs().max() < 1e-6, name
        for optimizer in optimizers:
            optimizer.step()


def test_the_memory_inputs_are_the_forward_s_and_what_it_cannot_run_beside_is_refused(megatron_world):
    from fe_megatron.hybrid_pattern import memory_positions
    from tests.helpers.configs import tiny_memory_config
    from tests.helpers.megatron import batches

    memory = tiny_memory_config(num_layers=3, layers=[1])
    assert memory_positions("*-|*-*-", [1, 2]) == {2: 1, 4: 2}  # '|' (a pipeline split) is no layer
    with pytest.raises(ValueError, match=r"memory layers \[3\] .* has 3 attention \('\*'\) layers"):
        memory_positions(PATTERN, [0, 3])
    with pytest.raises(ValueError, match="placement='before_ffn'.*before the attention of its attention layers"):
        hybrid_with_memory(tiny_memory_config(num_layers=3, layers=[1], placement="before_ffn"))

    model = hybrid_with_memory(memory)
    batch = batches(1)[0]
    layer = model.stage_memory_layers[0]
    with pytest.raises(RuntimeError, match=r"got no memory inputs: run it inside its model's forward"):
        layer(torch.randn(32, 2, 32), attention_mask=batch["attention_mask"])
    model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    assert layer.memory_inputs is None  # handed to the layers for the length of one forward only
    with pytest.raises(ValueError, match="needs input_ids"):
        model(None, batch["position_ids"], batch["attention_mask"], decoder_input=torch.randn(32, 2, 32))


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_under_full_recompute_each_recomputation_takes_its_own_microbatch_s_memory_inputs(megatron_world, method):
    """Full recompute runs every memory layer again in backward: with two microbatches' forwards before their
    backwards (as a pipeline schedule runs them), the losses and gradients are those without recompute, and
    those of the GPT model under full recompute."""
    from fe_megatron.hybrid_pattern import gpt_name_of
    from tests.helpers.configs import tiny_memory_config
    from tests.helpers.megatron import batches, build

    torch.manual_seed(7)
    memory = tiny_memory_config(num_layers=3, layers=[0, 2])
    recompute = dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=2)
    models = {"plain": hybrid_with_memory(memory), "recompute": hybrid_with_memory(memory, **recompute),
              "gpt_recompute": build(memory, num_layers=3, **recompute)}
    weights = dict(models["plain"].named_parameters())
    gpt_names = {gpt_name_of(name, PATTERN): name for name in weights}
    with torch.no_grad():
        for kind, model in models.items():
            for name, param in model.named_parameters():
                param.copy_(weights[gpt_names[name] if kind == "gpt_recompute" else name])
    microbatches = batches(2)
    grads, losses = {}, {}
    for kind, model in models.items():
        outputs = [model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]) for b in microbatches]
        mean_losses = [(out * b["loss_mask"]).sum() / b["loss_mask"].sum() for out, b in zip(outputs, microbatches)]
        losses[kind] = [loss.item() for loss in mean_losses]
        memory_layers = getattr(model, "stage_memory_layers", [])
        if kind == "recompute":  # both microbatches' checkpointed forwards wait for their recomputation; "block"
            # checkpoints layers 0 and 1 only, so the memory of layer 4 runs once, as without recompute
            assert [len(layer.pending_recomputations) for layer in memory_layers] == \
                ([2, 2] if method == "uniform" else [2, 0])
        for loss in mean_losses:  # the backwards after both forwards, oldest first
            loss.backward()
        assert all(not getattr(layer, "pending_recomputations", ()) for layer in memory_layers)
        names = (lambda name: gpt_names[name]) if kind == "gpt_recompute" else (lambda name: name)
        grads[kind] = {names(name): p.grad.clone() for name, p in model.named_parameters()}
    assert losses["recompute"] == losses["plain"] and max(
        abs(a - b) for a, b in zip(losses["gpt_recompute"], losses["plain"])) < 1e-6, losses
    for name, grad in grads["plain"].items():
        assert (grads["recompute"][name] - grad).abs().max() < 1e-6, name
        assert (grads["gpt_recompute"][name] - grad).abs().max() < 1e-6, name


def test_a_hybrid_model_with_memory_checkpoints_and_loads_its_memory(megatron_world, tmp_path):
    """A torch_dist checkpoint holds the memory under the pattern's layer numbers and loads back exactly
    into a model built from another seed."""
    from megatron.core import dist_checkpointing

    from tests.helpers.configs import tiny_memory_config

    memory = tiny_memory_config(num_layers=3, layers=[0, 2])
    torch.manual_seed(1)
    saved = hybrid_with_memory(memory)
    torch.manual_seed(2)
    loaded = hybrid_with_memory(memory)
    assert not torch.equal(saved.stage_memory_layers[1].memory.tables.weight,
                           loaded.stage_memory_layers[1].memory.tables.weight)
    sharded = saved.sharded_state_dict()
    assert {"decoder.layers.0.memory.tables.weight", "decoder.layers.4.memory.tables.weight",
            "decoder.layers.4.memory.dictionary"} <= set(sharded)
    dist_checkpointing.save(sharded, str(tmp_path))
    loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), str(tmp_path)))
    for (name, a), (_, b) in zip(saved.state_dict().items(), loaded.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
