"""The holders of a layer's table rows (`fe_megatron.tables.holders`): the engine's parameter, a `TableStore`
and the read-only serving rows (bf16, fp8, a mapped safetensors file) answer one interface, so the module
(`fe_megatron.memory.tables.NgramTables`) reads, draws, hands over and saves its rows without asking which
holder it has. On fresh random tables and ids."""

import copy

import pytest
import torch
from safetensors.torch import save_file

from fe_megatron.hf.mmap_tables import mapped_tensor
from fe_megatron.memory import build_memory
from fe_megatron.tables.holders import EngineParameter, ModuleLookup, ReadOnlyRows
from fe_megatron.tables.storage import dequantize_rows, quantize_table
from fe_megatron.tables.store import StoreLookup, TableStore
from tests.helpers.configs import small_config

HOLDERS = ["parameter", "device store", "host store", "bf16", "fp8", "mapped bf16"]


def tables_held_by(holder: str, tmp_path):
    """A branch whose tables ``holder`` holds, drawn from seed 11, and the fp32 rows it must read."""
    table_dtype = {"bf16": "bf16", "fp8": "fp8", "mapped bf16": "bf16"}.get(holder, "fp32")
    branch = build_memory(small_config(table_dtype=table_dtype), 1)
    branch.reset_parameters(seed=11)
    tables = branch.tables
    scales = tables.row_scale.detach() if table_dtype == "fp8" else None
    expected = dequantize_rows(tables.weight.detach().clone(), scales)
    if holder.endswith("store"):
        tables.manage(holder.split()[0])
    elif holder.startswith("mapped"):
        save_file({"rows": tables.weight.detach().contiguous()}, str(tmp_path / "tables.safetensors"))
        tables.release_for_mapping()
        tables.weight = mapped_tensor(str(tmp_path / "tables.safetensors"), "rows")  # as hf.mmap_tables maps it
    return branch, expected


@pytest.mark.parametrize("holder", HOLDERS)
def test_every_holder_reads_the_rows_it_was_given(holder, tmp_path):
    branch, expected = tables_held_by(holder, tmp_path)
    indices = torch.randint(0, expected.shape[0], (3, 7, branch.config.num_branches))
    lookup = branch.tables.start_lookup(indices, torch.device("cpu"))
    assert isinstance(lookup, StoreLookup if holder.endswith("store") else ModuleLookup)
    rows = lookup.rows()
    assert rows.shape == (3, 7, branch.config.num_branches, expected.shape[1]) and rows.dtype == torch.float32
    torch.testing.assert_close(rows.detach(), expected[indices], rtol=0, atol=0)
    torch.testing.assert_close(branch.tables.gather(indices), expected[indices].flatten(-2), rtol=0, atol=0)
    assert rows.requires_grad == (not isinstance(branch.tables.holder, ReadOnlyRows))  # nothing trains serving rows


@pytest.mark.parametrize("holder", ["parameter", "device store"])
def test_a_trained_holder_receives_the_gradient_of_its_rows(holder, tmp_path):
    branch, expected = tables_held_by(holder, tmp_path)
    if holder.endswith("store"):
        branch.tables.store.allocate_gradient(torch.float32)
    indices = torch.randint(0, expected.shape[0], (2, 5, branch.config.num_branches))
    weight = torch.randn(2, 5, branch.config.num_branches, expected.shape[1])
    (branch.tables.start_lookup(indices, torch.device("cpu")).rows() * weight).sum().backward()
    gradient = branch.tables.weight.grad if holder == "parameter" else branch.tables.store.main_grad
    reference = torch.zeros_like(expected).index_put_((indices.reshape(-1),), weight.flatten(0, -2), accumulate=True)
    torch.testing.assert_close(gradient, reference)


@pytest.mark.parametrize("holder", ["parameter", "bf16"])
def test_a_store_takes_over_the_rows_and_the_state_dict_keeps_them(holder, tmp_path):
    branch, expected = tables_held_by(holder, tmp_path)
    before = branch.state_dict()["tables.weight"].clone()
    store = branch.tables.manage("device")
    assert isinstance(store, TableStore) and branch.tables.holder is store
    assert "tables.weight" not in dict(branch.named_parameters())
    assert branch.tables.holder.outside_module == {"weight": store.weight}
    assert torch.equal(branch.state_dict()["tables.weight"], before)
    fresh = torch.randn(before.shape).to(before.dtype)
    branch.load_state_dict(dict(branch.state_dict(), **{"tables.weight": fresh}))
    assert torch.equal(store.weight, fresh)  # loaded in place, into the store
    assert branch.tables.manage("host") is store  # idempotent


@pytest.mark.parametrize("holder, why", [("fp8", "this one is fp8"),
                                         ("mapped bf16", "mapped from a file")])
def test_read_only_rows_are_not_handed_to_a_store(holder, why, tmp_path):
    branch, _ = tables_held_by(holder, tmp_path)
    with pytest.raises(ValueError, match=f"only fp32 and bf16 tables held in memory can be trained from a store; "
                                         f".*{why}"):
        branch.tables.manage("device")
    assert isinstance(branch.tables.holder, ReadOnlyRows)


def test_an_unmapped_table_is_not_drawn_and_refuses_a_lookup():
    branch = build_memory(small_config(), 1)
    branch.tables.release_for_mapping()
    branch.reset_parameters(seed=3)  # draws every other weight; the rows come from a file
    assert branch.tables.weight.is_meta
    drawn = [name for name, param in branch.named_parameters() if param.abs().sum() > 0]
    assert drawn and not any(name.startswith("tables.") for name in drawn)
    with pytest.raises(RuntimeError, match="neither in memory nor mapped: table_storage='mmap' maps them"):
        branch.tables.gather(torch.zeros(2, branch.config.num_branches, dtype=torch.long))


def test_an_fp8_table_is_drawn_as_the_fp32_draw_quantized():
    full = build_memory(small_config(), 1)
    full.reset_parameters(seed=5)
    quantized = build_memory(small_config(table_dtype="fp8"), 1)
    quantized.reset_parameters(seed=5)
    stored = quantize_table(full.tables.weight, "fp8")
    assert torch.equal(quantized.tables.weight.float(), stored["weight"].float())
    assert torch.equal(quantized.tables.row_scale, stored["row_scale"])


@pytest.mark.parametrize("holder", ["parameter", "fp8", "device store"])
def test_a_copied_module_reads_its_own_rows(holder, tmp_path):
    """The engine's and the serving holders read the module's tensors: a copy's holder reads the copy's."""
    branch, expected = tables_held_by(holder, tmp_path)
    copied = copy.deepcopy(branch)
    assert copied.tables.holder is not branch.tables.holder
    with torch.no_grad():
        branch.tables.weight.copy_(torch.zeros(branch.tables.weight.shape))
    indices = torch.randint(0, expected.shape[0], (4, branch.config.num_branches))
    torch.testing.assert_close(copied.tables.gather(indices), expected[indices].flatten(-2), rtol=0, atol=0)


def test_the_engines_parameter_is_read_when_replaced():
    """transformers' loading and DeepSpeed put new parameters in the module; the holder reads what is there."""
    branch = build_memory(small_config(), 1)
    assert isinstance(branch.tables.holder, EngineParameter)
    replacement = torch.nn.Parameter(torch.randn(branch.tables.weight.shape))
    branch.tables.weight = replacement
    indices = torch.randint(0, replacement.shape[0], (4, branch.config.num_branches))
    torch.testing.assert_close(branch.tables.gather(indices), replacement.detach()[indices].flatten(-2), rtol=0, atol=0)


@pytest.mark.parametrize("holder", ["parameter", "fp8"])
def test_a_started_lookup_reads_the_rows_through_the_module_s_call(holder, tmp_path):
    """ZeRO-3 gathers a partitioned parameter in hooks around the module's forward: a lookup started ahead of
    the forward gathers nothing until the branch reads it, and the branch reads it by calling the module, so
    those hooks have run when the rows are gathered. The holder never calls the module back (one way)."""
    branch, expected = tables_held_by(holder, tmp_path)
    calls = []
    branch.tables.register_forward_pre_hook(lambda module, args: calls.append(args[0]))
    indices = torch.randint(0, expected.shape[0], (2, 3, branch.config.num_branches))
    lookup = branch.tables.start_lookup(indices, torch.device("cpu"))
    torch.testing.assert_close(lookup.rows().float(), expected[indices].float(), rtol=0, atol=0)
    assert calls == []  # read by itself, the lookup asked its holder only
    hidden = torch.randn(2, 3, branch.config.hidden_size)
    rows = branch.lookup(hidden, None, lookup)
    assert calls == [lookup]
    torch.testing.assert_close(rows, expected[indices].flatten(-2).to(hidden.dtype), rtol=0, atol=0)
