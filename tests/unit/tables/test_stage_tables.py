"""Training from table stores (`fe_megatron.tables.stage_tables`, `store`): a store gathers and accumulates
exactly what the table parameter would, casts and moves leave it as it is, a sparse update's row
gradients, norm and clipping are the dense ones on the touched rows, and the owner alone holds the
tables' rows, gradients, layouts and optimizer state (nothing hangs on a tensor)."""

import copy

import pytest
import torch

from fe_megatron.memory import FactorEngram
from fe_megatron.tables.plan import TablePlan
from fe_megatron.tables.stage_tables import StageTables
from fe_megatron.tables.sparse_update import LazyAdam, RowwiseAdagrad
from fe_megatron.tables.store import TableStore
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
    expected = backward(branch, hidden, ids)
    tables = StageTables({"branch": stored}, OptimizerArgs(), TablePlan.resolve(placement=placement))
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
    StageTables({"branch": branch}, OptimizerArgs(), TablePlan.resolve(dtype="bf16", state_dtype="bf16",
                                                                        placement="host"))
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
    args = OptimizerArgs(lr=0.05, weight_decay=0.1)
    tables = StageTables({"branch": stored}, args, TablePlan.resolve(placement=placement, update=update))
    before = stored.tables.weight.clone()
    reference = branch.tables.weight
    reference_store = TableStore(reference, "device")  # the same rows: the update lands in the parameter
    reference_gradients = reference_store.allocate_row_gradients()
    reference_optimizer = (RowwiseAdagrad([reference_store], lr=0.05, eps=args.eps, weight_decay=0.1)
                           if update == "rowwise_adagrad" else
                           LazyAdam([reference_store], lr=0.05, betas=(args.beta1, args.beta2), eps=args.eps,
                                    weight_decay=0.1))
    for step in range(3):
        hidden = torch.randn(2, 16, config.hidden_size)
        ids = torch.randint(0, config.vocab_size, (2, 16))
        ids[0, :8] = 3
        for model in (branch, stored):
            memory, l1 = model(hidden, ids)
            (memory.square().sum() + l1.sum()).backward()
        touched = reference.grad.abs().sum(dim=1).nonzero().flatten()
        reference_gradients.clear()
        reference_gradients.add(touched, reference.grad[touched])
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
    dense_tables = StageTables({"b": dense}, OptimizerArgs(), TablePlan.resolve())
    sparse_tables = StageTables({"b": sparse}, OptimizerArgs(), TablePlan.resolve(update="rowwise_adagrad"))
    hidden, ids = torch.randn(2, 16, config.hidden_size), torch.randint(0, config.vocab_size, (2, 16))
    for model in (dense, sparse):
        memory, l1 = model(hidden, ids)
        (memory.square().sum() + l1.sum()).backward()
    assert sparse_tables.grad_norm() == pytest.approx(dense_tables.grad_norm(), rel=1e-6)
    sparse_tables.clip(0.5)
    ids_, rows = sparse.tables.store.row_gradients.coalesce()
    torch.testing.assert_close(rows, 0.5 * dense.tables.store.main_grad[ids_])


@pytest.mark.parametrize("update", ["adamw", "rowwise_adagrad", "partial_rowwise_adam"])
def test_the_owner_alone_holds_the_tables_state(update):
    """After a step the rows' tensor carries nothing (no gradient, layout or row gradients as
    attributes); the owner answers for the rows, the gradient, the layout and the optimizer state, all
    from its plan."""
    branch, hidden, ids = branch_and_inputs()
    plan = TablePlan.resolve(update=update, placement="host")
    tables = StageTables({"branch": branch}, OptimizerArgs(), plan)
    backward(branch, hidden, ids)
    tables.step()
    name = "branch.tables.weight"
    store = tables.stores[name]
    assert vars(store.weight) == {} and store.weight.grad is None
    assert store.placement == plan.placement and tables.rule is plan.rule
    assert tables.layouts == [store.layout] and store.layout.table == branch.layer_index
    assert tables.optimizer.stores[store.weight] is store and tables.optimizer.layouts[store.weight] is store.layout
    assert set(tables.optimizer.state[store.weight]) == {"step", *(entry.key for entry in plan.rule.state)}
    assert (store.row_gradients is not None) == plan.sparse and (store.main_grad is None) == plan.sparse
    assert branch.tables.weight is store.weight  # the module reads the owner's rows


def test_the_plan_s_holder_and_the_branch_s_rows_must_agree():
    """The table plan decides who holds the rows (`TablePlan.holder`): a row-sharded plan over a branch built
    with whole tables is refused by name, before any row moves."""
    branch, _, _ = branch_and_inputs()
    with pytest.raises(ValueError, match=r"branch: the table plan keeps the tables as row_sharded_store \(table_sharding "
                                         r"'rows'\), but the branch was built with whole tables"):
        StageTables({"branch": branch}, OptimizerArgs(), TablePlan.resolve(sharding="rows"))
    assert branch.tables.store is None
