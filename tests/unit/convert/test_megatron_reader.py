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
