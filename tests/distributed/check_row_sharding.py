"""Row-sharded tables against whole tables, and tables in stores (bf16, host memory, bf16 optimizer
state) against tables held as parameters, through fe-pretrain's own checkpoints.

Run (one phase per invocation; tests/integration/test_row_sharding.py, test_table_stores.py and
test_table_update.py chain them):
  torchrun --nproc_per_node N tests/distributed/check_row_sharding.py --tables rows|node|replicated --tp T --pp P \
      [--placement device|host] [--table-dtype fp32|bf16] [--state-dtype fp32|bf16] \
      [--table-update RULE (fe_megatron.tables.update_rules)] \
      [--init DIR | --save-init DIR] [--load DIR] --steps A:B [--record F | --compare F [--tol X]] \
      [--save-step K DIR] [--save-final DIR | --compare-final DIR] [--check-memory]

``--check-memory`` also checks, with rows, no pipeline and more than one data-parallel rank, that DDP
refuses row-sharded tables left as parameters; with node (node-shared tables, host memory), that each
rank's rows are its slice of the node's shared segment, which holds every rank's rows once.

Every phase trains the tiny GPT (memory at layers 1 and 2) with Adam and clipping on the same
global batches: 4 sequences per step, split over the data-parallel ranks.  Step 0 is random
text, step 1 a microbatch of one repeated token (every row requested many times), step 2 a
microbatch whose positions request no row twice.  Losses, gradient norms and (through a
checkpoint) every parameter are compared within 1e-5 relative in fp32 (``--tol`` for bf16
storage).  With the host tier each microbatch's rows are fetched one microbatch ahead, as
fe-pretrain fetches them.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from common import Checker, build_hybrid_model, tiny_memory_config, tiny_transformer_config
from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
from fe_megatron.checkpoint.commit import find_checkpoint  # noqa: E402
from fe_megatron.megatron.checkpointing import load_checkpoint, save_checkpoint
from fe_megatron.megatron.parallel import initialize
from fe_megatron.megatron.step import causal_mask, train_step
from fe_megatron.tables.lookahead import HOST_POSITION_IDS, HOST_TOKENS
from fe_megatron.tables.update_rules import TABLE_UPDATES
from fe_megatron.memory.branch import memory_branches

SEQ, GLOBAL_BATCH, STEPS = 32, 4, 3


STORAGE = {"table_dtype": "fp32", "table_placement": "device"}  # set from the command line in main()


def memory_config():
    return tiny_memory_config(table_capacity=[128, 4001, 4003], **STORAGE)


def rows_requested(tokens: torch.Tensor) -> tuple:
    """(positions, distinct rows) each memory layer looks up for one sequence."""
    from fe_megatron.ngram import NgramHasher

    per_layer = NgramHasher(memory_config()).indices_per_layer(tokens[None, :-1])
    return [(idx.numel(), torch.unique(idx).numel()) for idx in per_layer.values()]


def global_batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    if step == 1:  # heavy duplicates: one token everywhere
        return torch.full((GLOBAL_BATCH, SEQ + 1), 17, dtype=torch.int64)
    if step == 2:  # no duplicates: every sequence's positions request distinct rows (no hash collision either)
        sequences = []
        while len(sequences) < GLOBAL_BATCH:
            candidate = torch.randperm(128, generator=gen)[:SEQ + 1]
            if all(positions == distinct for positions, distinct in rows_requested(candidate)):
                sequences.append(candidate)
        return torch.stack(sequences)
    return torch.randint(0, 128, (GLOBAL_BATCH, SEQ + 1), generator=gen)


def my_batches(step: int):
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    tokens = global_batch(step).chunk(dp)[rank]
    batches = [dict(tokens=t[None, :-1], labels=t[None, 1:], loss_mask=torch.ones(1, SEQ),
                    position_ids=torch.arange(SEQ)[None], attention_mask=causal_mask(SEQ)) for t in tokens]
    if STORAGE["table_placement"] == "host":  # as fe-pretrain feeds the host tier: the ids on the host too
        for batch in batches:
            batch[HOST_TOKENS], batch[HOST_POSITION_IDS] = batch["tokens"], batch["position_ids"]
    return batches


def build(tables: str, tp: int, pp: int = 1, recompute: bool = False, state_dtype: str = "fp32",
          update: str = "adamw", model_kind: str = "gpt"):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from fe_megatron.megatron.table_optimizer import manage_tables
    from fe_megatron.tables.plan import TablePlan
    from fe_megatron.training.config import OptimizerArgs

    initialize(tensor_parallel_size=tp, pipeline_parallel_size=pp, seed=7)
    mc = memory_config()
    cfg = tiny_transformer_config(tp=tp, pp=pp, **(dict(recompute_granularity="full", recompute_method="uniform",
                                                         recompute_num_layers=1) if recompute else {}))
    model = build_hybrid_model(cfg, mc, SEQ, tables) if model_kind == "hybrid" else \
        build_gpt_model(cfg, 128, SEQ, mc, table_sharding=tables)
    with torch.no_grad():  # V and the conv start at zero: perturb them so every parameter learns at once
        for layer in model.stage_memory_layers:
            layer.memory.value_proj.weight.normal_(std=0.05)
            layer.memory.conv.weight.normal_(std=0.1)
    args = OptimizerArgs(lr=1e-2, min_lr=1e-3, weight_decay=0.01, beta1=0.9, beta2=0.999, clip_grad=0.5,
                         table_lr_mult=2.0)
    plan = TablePlan.resolve("megatron", mc.table_dtype, state_dtype, mc.table_placement, tables, update)
    stores = manage_tables(model, args, plan, torch.device("cpu"), seed=7) if plan.in_stores else None
    ddp = wrap_ddp(model, cfg)
    opt = build_optimizer([ddp], OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01,
                                                 clip_grad=0.5), table_lr_mult=2.0, tables=stores)
    connect_schedule_hooks(cfg, [ddp], opt)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1,
                                    lr_decay_steps=STEPS, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=STEPS, wd_incr_style="constant")
    return model, ddp, opt, sched


def save_model(model, path):
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), path)


def load_model(model, path):
    from megatron.core import dist_checkpointing

    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))


def check_memory(check: Checker, model, ddp, tables: str):
    """Each rank holds about 1/N of every table, and so does its store's gradient accumulator; DDP's
    buffers hold no table."""
    from megatron.core import parallel_state

    from fe_megatron.megatron.parallel import table_row_group

    n = dist.get_world_size(table_row_group())
    check.true(f"the tables' row group is DP x CP ({n})", n == parallel_state.get_data_parallel_world_size())
    dense_buffer = sum(buffer.numel for buffer in ddp.buffers)
    for layer in model.stage_memory_layers:
        weight, partition = layer.memory.tables.weight, layer.memory.row_partition
        total_rows = sum(partition.branch_rows)
        bound = total_rows / n + len(partition.branch_rows)  # one row of rounding per branch
        check.true(f"layer {layer.layer_index}: {weight.shape[0]} local rows <= {bound:.0f} (total {total_rows})",
                   total_rows / n - len(partition.branch_rows) <= weight.shape[0] <= bound)
        main_grad = layer.memory.tables.store.main_grad
        check.true("table gradient accumulator is the shard's size", main_grad.numel() == weight.numel())
        check.true("table and gradient bytes are 1/N of the table's",
                   (weight.numel() + main_grad.numel()) * 4 <= 2 * 4 * bound * weight.shape[1])
        check.true("no table in DDP's buffers",
                   all(weight is not p for buffer in ddp.buffers + ddp.expert_parallel_buffers for p in buffer.params))
        if tables == "node":
            node = layer.memory.tables.store.node
            segment = node.segment.weight
            check.true(f"node-shared: the node's segment holds every rank's rows once ({segment.shape[0]} rows)",
                       segment.shape[0] == total_rows and node.same_node.all())
            first = int(node.first_rows[dist.get_rank(table_row_group())])
            check.true("node-shared: this rank's rows are its slice of the segment",
                       weight.data_ptr() == segment[first:].data_ptr() and weight.is_shared())
    check.true("the dense buffer exists", dense_buffer > 0)


def check_ddp_refuses_row_sharded_parameters(check: Checker, tp: int):
    """Row-sharded tables left as parameters are refused by wrap_ddp, which would all-reduce rows
    that differ on every data-parallel rank (the engines move them into stores first)."""
    model = build_gpt_model(tiny_transformer_config(tp=tp), 128, SEQ, memory_config(), table_sharding="rows")
    try:
        wrap_ddp(model, tiny_transformer_config(tp=tp))
        message = "(it accepted them)"
    except ValueError as err:
        message = str(err)
    check.true(f"wrap_ddp refuses row-sharded tables left as parameters, naming them and the fix: {message}",
               "row-sharded tables" in message and "tables.weight" in message and "manage_tables" in message)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tables", choices=["rows", "node", "replicated"], required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--recompute", action="store_true", help="full activation recompute")
    parser.add_argument("--save-init")
    parser.add_argument("--init")
    parser.add_argument("--load")
    parser.add_argument("--steps", required=True)
    parser.add_argument("--record")
    parser.add_argument("--compare")
    parser.add_argument("--save-step", nargs=2)
    parser.add_argument("--save-final")
    parser.add_argument("--compare-final")
    parser.add_argument("--check-memory", action="store_true")
    parser.add_argument("--placement", choices=["device", "host"], default="device")
    parser.add_argument("--table-dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--state-dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--table-update", choices=TABLE_UPDATES, default="adamw")
    parser.add_argument("--tol", type=float, default=1e-5, help="relative tolerance of every comparison")
    parser.add_argument("--model", default="gpt", choices=["gpt", "hybrid"],
                        help="hybrid: the hybrid model with memory, a '*-' pair per GPT layer")
    args = parser.parse_args()
    STORAGE.update(table_dtype=args.table_dtype, table_placement=args.placement)
    first, last = (int(x) for x in args.steps.split(":"))
    check = Checker()
    model, ddp, opt, sched = build(args.tables, args.tp, args.pp, args.recompute, args.state_dtype,
                                   args.table_update, args.model)
    if args.save_init:
        save_model(model, args.save_init)
    if args.init:
        load_model(model, args.init)
    if args.load:
        start = load_checkpoint(find_checkpoint(args.load), [ddp], opt, sched)
        check.true(f"resumed at {start} == {first}", start == first)
    if args.check_memory:
        check_memory(check, model, ddp, args.tables)
    duplicates = {step: rows_requested(global_batch(step)[0]) for step in (1, 2)}
    check.true(f"step 1 requests each row many times: {duplicates[1]}",
               all(distinct * 8 <= positions for positions, distinct in duplicates[1]))
    check.true(f"step 2 requests no row twice: {duplicates[2]}",
               all(distinct == positions for positions, distinct in duplicates[2]))
    reference = json.load(open(args.compare)) if args.compare else None
    record = {}
    for step in range(first, last):
        lm, sparsity, grad_norm, ok = train_step([ddp], opt, my_batches(step), SEQ, 1)
        sched.step(increment=1)
        record[str(step)] = [lm, sparsity, float(grad_norm)]
        if reference:
            for name, mine, theirs in zip(("lm loss", "sparsity", "grad norm"), record[str(step)],
                                          reference[str(step)]):
                check.close(f"step {step} {name}", torch.tensor(mine), torch.tensor(theirs), args.tol)
        if args.save_step and step + 1 == int(args.save_step[0]):
            save_checkpoint(args.save_step[1], [ddp], opt, sched, step + 1)
    if args.record and dist.get_rank() == 0:
        json.dump(record, open(args.record, "w"))
    if args.save_final:
        save_model(model, args.save_final)
    if args.compare_final:
        mine = {n: p.detach().float().clone() for n, p in weights(model).items()}
        load_model(model, args.compare_final)
        for name, param in weights(model).items():
            check.close(f"parameter {name} after step {last - 1}", mine[name], param.detach().float(), args.tol)
    from megatron.core import parallel_state

    # after training, as it draws random weights; DDP reduces over the expert-data-parallel ranks, so
    # it refuses row-sharded tables where that group has more than one
    if args.check_memory and args.tables == "rows" and args.pp == 1 and \
            parallel_state.get_expert_data_parallel_world_size() > 1:
        check_ddp_refuses_row_sharded_parameters(check, args.tp)
    check.finish()


def weights(model) -> dict:
    """Every parameter of the model, and the tables that live in stores (no parameters of the model)."""
    tables = {f"{name}.tables.weight": branch.tables.weight for name, branch in memory_branches(model).items()}
    return dict(model.named_parameters(), **tables)


if __name__ == "__main__":
    main()
