"""`fe_megatron.megatron.hybrid_specs`: megatron-core's hybrid stack from its local layers trains on a CPU,
and a pattern of ``*-`` pairs is the GPT layer structure: with the GPT model's weights it gives the same
logits and the same gradients. The layer kinds it does not build are named."""

import pytest
import torch

from fe_megatron.megatron import compat

pytestmark = pytest.mark.skipif(not compat.has_hybrid_model(), reason=(
    f"megatron-core {compat.megatron_core_version()} has no HybridModel ({compat.HYBRID_MINIMUM} on); "
    "`make test-newest` runs these tests"))


def hybrid_model(pattern: str, **overrides):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from fe_megatron.megatron.hybrid_specs import local_hybrid_stack_spec
    from tests.helpers.configs import tiny_transformer_config

    config = tiny_transformer_config(num_layers=len(pattern), **overrides)
    return HybridModel(config=config, hybrid_stack_spec=local_hybrid_stack_spec(), vocab_size=128,
                       max_sequence_length=32, hybrid_layer_pattern=pattern, position_embedding_type="rope",
                       share_embeddings_and_output_weights=True)


def test_a_pattern_of_attention_mlp_pairs_is_the_gpt_model(megatron_world):
    from fe_megatron.hybrid_pattern import gpt_name_of
    from fe_megatron.megatron.hybrid_specs import LocalHybridStack
    from tests.helpers.megatron import batches, build

    torch.manual_seed(3)
    pattern = "*-*-*-"
    gpt, hybrid = build(num_layers=3), hybrid_model(pattern)
    assert isinstance(hybrid.decoder, LocalHybridStack) and isinstance(hybrid.decoder.final_norm, torch.nn.RMSNorm)
    gpt_params = dict(gpt.named_parameters())
    names = {name: gpt_name_of(name, pattern) for name, _ in hybrid.named_parameters()}
    assert sorted(names.values()) == sorted(gpt_params)  # every GPT weight, once
    with torch.no_grad():
        for name, param in hybrid.named_parameters():
            param.copy_(gpt_params[names[name]] + 0.01 * torch.randn_like(param))  # fresh values, not the init
            gpt_params[names[name]].copy_(param)
    batch = batches(1)[0]
    outputs = []
    for model in (gpt, hybrid):
        logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        (logits.float().log_softmax(-1).mean() * 3).backward()
        outputs.append(logits.detach())
    assert (outputs[0] - outputs[1]).abs().max() < 1e-6
    for name, param in hybrid.named_parameters():
        assert (param.grad - gpt_params[names[name]].grad).abs().max() < 1e-6, name


def test_what_the_local_stack_cannot_build_is_named():
    from fe_megatron.hybrid_pattern import gpt_name_of
    from fe_megatron.megatron.hybrid_specs import local_pattern_problems

    assert local_pattern_problems("*-E-") == []
    problems = local_pattern_problems("M*-+")
    assert len(problems) == 2 and "'M' layers (Mamba)" in problems[0] and "'+' layers (MLA)" in problems[1]
    with pytest.raises(ValueError, match=r"'\*E' is not made of '\*-' pairs"):
        gpt_name_of("decoder.layers.0.input_layernorm.weight", "*E")
    with pytest.raises(ValueError, match=r"layer 2 is an attention layer \('\*'\), which holds no mlp.linear_fc1"):
        gpt_name_of("decoder.layers.2.mlp.linear_fc1.weight", "*-*-")
