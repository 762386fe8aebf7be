"""The Megatron layer with memory (`fe_megatron.megatron.transformer_layer`, `gpt_model`) in one process:
it runs the one plain memory module, its branch reads the pre-norm residual stream, and a bad
configuration fails at build time."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.configs import tiny_memory_config, tiny_transformer_config
from tests.helpers.megatron import batches, build


@pytest.mark.parametrize("kind", ["factorengram", "engram"])
def test_megatron_layer_runs_the_one_plain_memory_module(megatron_world, kind):
    """The Megatron layer's ``memory`` is the single-process class itself, with Megatron's
    hooks, and its parameters carry the sharding plan's attributes."""
    from fe_megatron.memory import Engram, FactorEngram
    from fe_megatron.memory.sharding import SHARDING_PLAN

    overrides = dict(kind="engram", gate="scalar", memory_dim=24) if kind == "engram" else {}
    model = build(tiny_memory_config(**overrides))
    assert len(model.stage_memory_layers) == 2
    for layer in model.stage_memory_layers:
        assert type(layer.memory) is {"factorengram": FactorEngram, "engram": Engram}[kind]
        assert type(layer.memory.parallel).__name__ == "MegatronParallelHooks"
        assert layer.memory.layer_index == layer.layer_number - 1
        for name, param in layer.memory.named_parameters():
            plan = SHARDING_PLAN[kind][name]
            assert getattr(param, "is_memory_table", False) == plan.is_table, name
            assert getattr(param, "tensor_model_parallel", False) == plan.tensor_parallel, name


def test_branch_reads_the_pre_norm_residual_stream(megatron_world):
    mc = tiny_memory_config(layers=[1])
    model = build(mc)
    layer = model.stage_memory_layers[0]
    seen = {}
    def record_branch_input(module, inputs, output):
        seen["h"] = inputs[0].detach()

    layer.memory.register_forward_hook(record_branch_input)
    def record_layer_input(module, args, kwargs):
        seen["x"] = kwargs["hidden_states"].detach()

    layer.register_forward_pre_hook(record_layer_input, with_kwargs=True)
    batch = batches(1)[0]
    model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    assert torch.equal(seen["h"], seen["x"])  # the layer input, before input_layernorm


@pytest.mark.parametrize("memory_overrides, transformer_overrides, fragment", [
    (dict(layers=[1, 2], num_layers=8), {}, r"MemoryConfig.backbone.num_layers=8 does not match "
                                            r"TransformerConfig.num_layers=4"),
    (dict(hidden_size=48), {}, "MemoryConfig.backbone.hidden_size=48 does not match"),
    (dict(placement="inside_ffn"), dict(gated_linear_unit=False, activation_func=F.gelu),
     "placement='inside_ffn' adds the memory to the SwiGLU up-projection"),
    (dict(placement="inside_ffn", ffn_hidden_size=96), {}, "MemoryConfig.backbone.ffn_hidden_size=96 does not match"),
    (dict(placement="inside_ffn"), dict(glu_linear_offset=1.0), "without glu_linear_offset or activation_func_clamp"),
])
def test_bad_configuration_fails_at_build_time(megatron_world, memory_overrides, transformer_overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        build(tiny_memory_config(**memory_overrides), **transformer_overrides)


def test_layer_beyond_model_depth_fails_at_build_time(megatron_world):
    # the config is valid for a 24-layer model, the Megatron model has 4 layers
    mc = tiny_memory_config(num_layers=24, layers=[10, 12])
    with pytest.raises(ValueError, match=r"layer 10 \(0-based\) is beyond the model's num_layers=4"):
        build(mc)


def test_tp_size_must_divide_branch_width():
    from fe_megatron.megatron.transformer_layer import validate_against_transformer_config

    mc = tiny_memory_config(coeff_width=18)  # s_b = 3
    cfg = tiny_transformer_config(tp=2)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 does not divide the branch width s_b=3"):
        validate_against_transformer_config(mc, cfg)


def test_missing_token_ids_on_a_memory_stage(megatron_world):
    model = build(tiny_memory_config())
    batch = batches(1)[0]
    with pytest.raises(ValueError, match="needs input_ids"):
        model(None, batch["position_ids"], batch["attention_mask"], decoder_input=torch.randn(32, 2, 32))


def test_inside_ffn_adds_the_memory_to_the_up_branch_of_megatrons_own_mlp(megatron_world):
    """``mlp_with_up_addend`` runs megatron-core's ``MLP.forward`` with ``m`` on the up branch:
    ``fc2(silu(x W_gate) * (x W_up + m))``, by hand from the MLP's weights, on fresh random values."""
    from fe_megatron.megatron.transformer_layer import mlp_with_up_addend

    torch.manual_seed(11)
    model = build(tiny_memory_config(placement="inside_ffn"))
    mlp = model.stage_memory_layers[0].mlp
    with torch.no_grad():
        for param in mlp.parameters():
            param.normal_(0, 0.2)
    x, m = torch.randn(5, 2, 32), torch.randn(5, 2, 64)
    out, bias = mlp_with_up_addend(mlp, x, m)
    gate_weight, up_weight = mlp.linear_fc1.weight.chunk(2, dim=0)
    expected = (F.silu(x @ gate_weight.t()) * (x @ up_weight.t() + m)) @ mlp.linear_fc2.weight.t()
    assert bias is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    plain, _ = mlp(x)  # the hook is gone after the call
    torch.testing.assert_close(plain, (F.silu(x @ gate_weight.t()) * (x @ up_weight.t())) @ mlp.linear_fc2.weight.t(),
                               rtol=1e-5, atol=1e-6)
