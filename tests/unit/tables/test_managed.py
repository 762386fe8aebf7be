"""Training from table stores (`fe_megatron.tables.managed`, `store`): a store gathers and accumulates
exactly what the table parameter would, casts and moves leave it as it is, and a sparse update's row
gradients, norm and clipping are the dense ones on the touched rows."""

import copy

import pytest
import torch

from fe_megatron.memory import FactorEngram
from fe_megatron.tables.managed import ManagedTables
from fe_megatron.tables.sparse_update import LazyAdam, RowwiseAdagrad
from fe_megatron.tables.store import RowGradients
from fe_megatron.training.config import OptimizerArgs
from tests.helpers.configs import small_config


def branch_and_inputs(**storage):
    config = small_config(**storage)
    branch = FactorEngram(config, layer_index=config.layers[0])
    with torch.no_grad():
        branch.value_proj.weight.normal_(std=0.05)  # V starts at zero: give the tables a gradient
    hidden = torch.randn(3, 20, config.hidden_size)
    ids = torch.randint(0, config.vocab_size, (3, 20))
    ids[1] = 5  # one row looked up many times
    return branch, hidden, ids


def backward(branch, hidden, ids):
    memory, l1 = branch(hidden, ids)
    (memory.square().sum() + l1.sum()).backward()
    return memory


@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_store_gathers_and_accumulates_what_the_parameter_would(placement):
    branch, hidden, ids = branch_and_inputs()
    stored = copy.deepcopy(branch)
    stored.config = stored.config.replace(table_placement=placement)
    expected = backward(branch, hidden, ids)
    tables = ManagedTables({"branch": stored}, OptimizerArgs(), "fp32")
    got = backward(stored, hidden, ids)
    tables.reduce_gradients()
    store = stored.tables.store
    assert torch.equal(got, expected)
    torch.testing.assert_close(store.main_grad, branch.tables.weight.grad, rtol=1e-6, atol=1e-7)
    assert "tables.weight" not in dict(stored.named_parameters())  # no framework sees it as a parameter
    assert "tables.weight" not in dict(stored.named_buffers())  # nor as a buffer (DDP would broadcast it)
    assert stored.state_dict(keep_vars=True)["tables.weight"] is store.weight  # checkpoints do, by the same name
    saved = stored.state_dict()["tables.weight"]  # detached: without the store's main_grad or layout
    assert torch.equal(saved, store.weight) and not hasattr(saved, "main_grad") and not hasattr(saved, "table_layout")
    with pytest.raises(AttributeError, match="rows are in a TableStore"):
        stored.tables.weight = torch.zeros_like(store.weight)


def test_module_casts_and_moves_leave_a_store_as_it_is():
    branch, hidden, ids = branch_and_inputs(table_dtype="bf16", table_placement="host")
    ManagedTables({"branch": branch}, OptimizerArgs(), "bf16")
    rows = branch.tables.weight
    branch.to(torch.float64)
    assert branch.tables.weight.dtype == torch.bfloat16 and branch.dictionary.dtype == torch.float64
    branch.float()
    assert branch.tables.weight is rows and branch.dictionary.dtype == torch.float32
    assert branch.tables.store.main_grad.dtype == torch.bfloat16  # optimizer.table_state_dtype
    values = torch.randn(branch.tables.weight.shape)
    branch.load_state_dict(dict(branch.state_dict(), **{"tables.weight": values}))
    assert torch.equal(branch.tables.store.weight, values.to(torch.bfloat16))  # loaded into the store, rounded
    assert branch.tables.weight is rows  # in place
    state = branch.state_dict()
    with pytest.raises(RuntimeError, match=r"size mismatch for tables.weight: copying a table of shape \(3, "):
        branch.load_state_dict(dict(state, **{"tables.weight": torch.randn(3, rows.shape[1])}))
    del state["tables.weight"]
    with pytest.raises(RuntimeError, match="Missing key.*tables.weight"):
        branch.load_state_dict(state)
    branch.load_state_dict(state, strict=False)  # not strict: a missing table is left as it is
    assert torch.equal(branch.tables.store.weight, values.to(torch.bfloat16))


@pytest.mark.parametrize("update", ["rowwise_adagrad", "lazy_adam"])
@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_branch_s_row_gradients_are_autograd_s_on_the_touched_rows(update, placement):
    """The store keeps the gradient by row; the update it drives equals the rule applied to
    autograd's dense gradient of the same branch, and rows no position read do not move."""
    config = small_config()
    branch = FactorEngram(config, layer_index=config.layers[0])
    with torch.no_grad():
        branch.value_proj.weight.normal_(std=0.05)
    stored = copy.deepcopy(branch)
    stored.config = stored.config.replace(table_placement=placement)
    args = OptimizerArgs(lr=0.05, weight_decay=0.1)
    tables = ManagedTables({"branch": stored}, args, update=update)
    before = stored.tables.weight.clone()
    reference = branch.tables.weight
    reference_optimizer = (RowwiseAdagrad([reference], lr=0.05, eps=args.eps, weight_decay=0.1)
                           if update == "rowwise_adagrad" else
                           LazyAdam([reference], lr=0.05, betas=(args.beta1, args.beta2), eps=args.eps,
                                    weight_decay=0.1))
    reference.row_gradients = RowGradients(reference.shape[1], reference.device)
    for step in range(3):
        hidden = torch.randn(2, 16, config.hidden_size)
        ids = torch.randint(0, config.vocab_size, (2, 16))
        ids[0, :8] = 3
        for model in (branch, stored):
            memory, l1 = model(hidden, ids)
            (memory.square().sum() + l1.sum()).backward()
        touched = reference.grad.abs().sum(dim=1).nonzero().flatten()
        reference.row_gradients.clear()
        reference.row_gradients.add(touched, reference.grad[touched])
        reference_optimizer.step()
        reference.grad = None
        tables.step()
        tables.zero_grad()
    torch.testing.assert_close(stored.tables.weight, reference.detach(), rtol=1e-5, atol=1e-6)
    moved = (stored.tables.weight != before).any(dim=1)
    assert 0 < int(moved.sum()) < before.shape[0] // 2  # the rows read, not the table


def test_the_sparse_gradient_norm_and_clip_are_the_dense_ones():
    config = small_config()
    branch = FactorEngram(config, layer_index=config.layers[0])
    with torch.no_grad():
        branch.value_proj.weight.normal_(std=0.05)
    dense, sparse = copy.deepcopy(branch), copy.deepcopy(branch)
    dense_tables = ManagedTables({"b": dense}, OptimizerArgs())
    sparse_tables = ManagedTables({"b": sparse}, OptimizerArgs(), update="rowwise_adagrad")
    hidden, ids = torch.randn(2, 16, config.hidden_size), torch.randint(0, config.vocab_size, (2, 16))
    for model in (dense, sparse):
        memory, l1 = model(hidden, ids)
        (memory.square().sum() + l1.sum()).backward()
    assert sparse_tables.grad_norm() == pytest.approx(dense_tables.grad_norm(), rel=1e-6)
    sparse_tables.clip(0.5)
    ids_, rows = sparse.tables.store.row_gradients.coalesce()
    torch.testing.assert_close(rows, 0.5 * dense.tables.store.main_grad[ids_])
