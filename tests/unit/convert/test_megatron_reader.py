"""`fe_megatron.convert.megatron_reader` reads a Megatron-FSDP checkpoint (``fsdp_dtensor``) as it reads a
torch_dist one: under the model's names, SwiGLU's halves joined, the tables from ``fe_tables/`` beside it."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fe_megatron.convert.common import ConversionError
from fe_megatron.convert.megatron_reader import DistCheckpoint, FsdpDtensorCheckpoint, open_checkpoint


def save(folder, tensors: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)


def test_an_fsdp_dtensor_checkpoint_reads_under_the_model_names(tmp_path):
    gate, up, proj, table = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 4), torch.randn(11, 3)
    folder = str(tmp_path / "iter_0000002")
    save(folder, {"model.module.decoder.layers.0.mlp.linear_fc1.weight_w": gate,
                  "model.module.decoder.layers.0.mlp.linear_fc1.weight_v": up,
                  "model.module.decoder.layers.0.self_attention.linear_proj.weight": proj,
                  "optimizer.state.module.decoder.layers.0.self_attention.linear_proj.weight.exp_avg": proj + 1})
    save(os.path.join(folder, "fe_tables"), {"decoder.layers.0.memory.tables.weight": table,
                                             "optimizer.state.exp_avg.decoder.layers.0.memory.tables.weight": table})

    reader = open_checkpoint(folder)
    assert isinstance(reader, FsdpDtensorCheckpoint)
    assert sorted(reader.weight_names()) == ["decoder.layers.0.memory.tables.weight",
                                             "decoder.layers.0.mlp.linear_fc1.weight",
                                             "decoder.layers.0.self_attention.linear_proj.weight"]
    assert reader.shape("decoder.layers.0.mlp.linear_fc1.weight") == (12, 4)
    assert torch.equal(reader.load("decoder.layers.0.mlp.linear_fc1.weight"), torch.cat([gate, up]))
    assert torch.equal(reader.load("decoder.layers.0.self_attention.linear_proj.weight"), proj)
    assert torch.equal(reader.load("decoder.layers.0.memory.tables.weight"), table)
    assert reader.dtype("decoder.layers.0.memory.tables.weight") == torch.float32


def test_a_torch_dist_checkpoint_keeps_its_reader_and_a_lone_swiglu_half_is_refused(tmp_path):
    plain = str(tmp_path / "plain")
    save(plain, {"decoder.layers.0.self_attention.linear_proj.weight": torch.randn(4, 4)})
    assert type(open_checkpoint(plain)) is DistCheckpoint

    half = str(tmp_path / "half")
    save(half, {"model.module.decoder.layers.0.mlp.linear_fc1.weight_w": torch.randn(6, 4)})
    with pytest.raises(ConversionError, match=r"linear_fc1.weight is stored as \['w'\]"):
        open_checkpoint(half)


def test_a_hybrid_checkpoint_of_pairs_reads_under_the_gpt_names_and_other_patterns_are_refused(tmp_path):
    """A HybridModel checkpoint whose run info names a pattern of '*-' pairs reads as the GPT model: layers 2i
    and 2i+1 are GPT layer i (`fe_megatron.hybrid_pattern`)."""
    import json

    from fe_megatron.checkpoint.files import RUN_INFO
    from fe_megatron.convert.megatron_reader import HybridAsGpt

    qkv, fc2, norm = torch.randn(12, 4), torch.randn(4, 8), torch.randn(4)
    folder = str(tmp_path / "iter_0000001")
    save(folder, {"decoder.layers.2.self_attention.linear_qkv.weight": qkv, "decoder.layers.3.mlp.linear_fc2.weight": fc2,
                  "decoder.final_norm.weight": norm, "optimizer.state.exp_avg.decoder.final_norm.weight": norm})
    with open(os.path.join(folder, RUN_INFO), "w") as fh:
        json.dump({"hybrid_layer_pattern": "*-|*-"}, fh)
    checkpoint = open_checkpoint(folder)
    assert isinstance(checkpoint, HybridAsGpt)
    assert sorted(checkpoint.weight_names()) == ["decoder.final_layernorm.weight",
                                                 "decoder.layers.1.mlp.linear_fc2.weight",
                                                 "decoder.layers.1.self_attention.linear_qkv.weight"]
    assert torch.equal(checkpoint.load("decoder.layers.1.mlp.linear_fc2.weight"), fc2)
    assert checkpoint.shape("decoder.layers.1.self_attention.linear_qkv.weight") == (12, 4)
    with pytest.raises(ConversionError, match=r"--hybrid-layer-pattern '\*E\*E'; only patterns of '\*-' pairs"):
        HybridAsGpt(folder, "*E*E", checkpoint.checkpoint)


def test_a_hybrid_checkpoint_under_megatron_fsdp_reads_its_halves_and_its_tables_under_the_gpt_names(tmp_path):
    """A HybridModel trained under Megatron-FSDP (``fsdp_dtensor``, the tables in stores): its model tensors behind
    FSDP's prefixes, fc1 as two halves, and the tables in ``fe_tables/`` beside it, all under the GPT model's names."""
    import json

    from fe_megatron.checkpoint.files import RUN_INFO
    from fe_megatron.convert.megatron_reader import HybridAsGpt

    gate, up, qkv, table = torch.randn(6, 4), torch.randn(6, 4), torch.randn(12, 4), torch.randn(11, 3)
    folder = str(tmp_path / "iter_0000003")  # GPT layer 1 is hybrid layers 2 ('*') and 3 ('-')
    save(folder, {"model.module.decoder.layers.3.mlp.linear_fc1.weight_w": gate,
                  "model.module.decoder.layers.3.mlp.linear_fc1.weight_v": up,
                  "model.module.decoder.layers.2.self_attention.linear_qkv.weight": qkv})
    # fe_tables/ names the tables by memory block (GPT layer 1), as for every model
    save(os.path.join(folder, "fe_tables"), {"decoder.layers.1.memory.tables.weight": table,
                                             "optimizer.state.exp_avg.decoder.layers.1.memory.tables.weight": table})
    with open(os.path.join(folder, RUN_INFO), "w") as fh:
        json.dump({"hybrid_layer_pattern": "*-*-"}, fh)
    reader = open_checkpoint(folder)
    assert isinstance(reader, HybridAsGpt) and isinstance(reader.checkpoint, FsdpDtensorCheckpoint)
    assert sorted(reader.weight_names()) == ["decoder.layers.1.memory.tables.weight",
                                             "decoder.layers.1.mlp.linear_fc1.weight",
                                             "decoder.layers.1.self_attention.linear_qkv.weight"]
    assert torch.equal(reader.load("decoder.layers.1.mlp.linear_fc1.weight"), torch.cat([gate, up]))
    assert torch.equal(reader.load("decoder.layers.1.memory.tables.weight"), table)
