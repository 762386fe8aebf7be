"""One stage's row exchange (`fe_megatron.tables.row_exchange.StageRowExchange`) against each layer
exchanging alone (`row_lookup`) and against whole tables, on fresh random tables, ids and gradients.

Run: torchrun --nproc_per_node N tests/distributed/check_stage_exchange.py

Three layers with different table layouts (their own branch sizes), each rank looking up its own
random ids (with repeats).  For each kind of shard (a plain parameter, whose gradient autograd
returns at once; a parameter whose gradient goes to ``main_grad`` as under Megatron's DDP; a
`TableStore`): the rows equal the whole tables' rows, and after backward every rank's shard
gradient equals its rows of the whole tables' gradient summed over all ranks' lookups.  The
exchange issues 3 all-to-alls in forward and 1 in backward for all three layers where the
gradients can wait (the deferred kinds), against 3 + 1 per layer alone.
"""

import torch
import torch.distributed as dist

from common import Checker
from fe_megatron.tables.row_exchange import RowPartition, StageRowExchange, row_lookup
from fe_megatron.tables.store import TableStore

LAYOUTS = [((7, 11, 13), 32), ((5, 17, 19), 48), ((9, 23, 29), 40)]  # (branch rows, positions per rank)
WIDTH = 4


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    check = Checker()
    gen = torch.Generator().manual_seed(0)  # the same whole tables on every rank
    partitions, wholes = [], []
    for branch_rows, _ in LAYOUTS:
        offsets = tuple(sum(branch_rows[:b]) for b in range(len(branch_rows)))
        partitions.append(RowPartition(branch_rows, offsets, world, rank))
        wholes.append(torch.randn(sum(branch_rows), WIDTH, generator=gen))
    everyone = []  # every rank's ids and output gradients, drawn alike everywhere
    for r in range(world):
        per_layer = []
        for (branch_rows, positions), whole in zip(LAYOUTS, wholes):
            ids = torch.randint(0, whole.shape[0], (positions,), generator=gen)
            ids[: positions // 4] = ids[0]  # repeats
            per_layer.append((ids.view(positions // 4, 4), torch.randn(positions // 4, 4, WIDTH, generator=gen)))
        everyone.append(per_layer)
    expected_grads = []
    for layer, whole in enumerate(wholes):
        grad = torch.zeros_like(whole)
        for r in range(world):
            ids, out_grad = everyone[r][layer]
            grad.index_add_(0, ids.reshape(-1), out_grad.reshape(-1, WIDTH))
        expected_grads.append(partitions[layer].take(grad))
    mine = everyone[rank]

    for kind in ("parameter", "main_grad", "store"):
        sources = []
        for partition, whole in zip(partitions, wholes):
            shard = partition.take(whole).clone()
            if kind == "store":
                store = TableStore(shard, "device")
                store.allocate_gradient(torch.float32)
                sources.append(store)
            else:
                param = torch.nn.Parameter(shard)
                if kind == "main_grad":
                    param.main_grad, param.grad_added_to_main_grad = torch.zeros_like(shard), False
                sources.append(param)
        counts = {"n": 0}
        real = dist.all_to_all_single

        def counting(*args, **kwargs):
            counts["n"] += 1
            return real(*args, **kwargs)

        dist.all_to_all_single = counting
        exchange = StageRowExchange(sources, [ids for ids, _ in mine], partitions, dist.group.WORLD)
        forward = counts["n"]
        outputs = [exchange.layer_lookup(layer).rows() for layer in range(len(LAYOUTS))]
        for layer, (out, (ids, _)) in enumerate(zip(outputs, mine)):
            check.equal(f"{kind}: layer {layer} rows", out, wholes[layer][ids])
        sum((out * grad).sum() for out, (_, grad) in zip(outputs, mine)).backward()
        backward = counts["n"] - forward
        dist.all_to_all_single = real
        check.true(f"{kind}: 3 all-to-alls in forward for 3 layers (got {forward})", forward == 3)
        expected_backward = 3 if kind == "parameter" else 1
        check.true(f"{kind}: {expected_backward} in backward (got {backward})", backward == expected_backward)
        for layer, source in enumerate(sources):
            got = source.main_grad if kind != "parameter" else source.grad
            check.close(f"{kind}: layer {layer} shard gradient", got, expected_grads[layer], 1e-6)

    # the same gradients through each layer's own exchange, for comparison
    params = [torch.nn.Parameter(p.take(w).clone()) for p, w in zip(partitions, wholes)]
    for layer, (param, (ids, grad)) in enumerate(zip(params, mine)):
        lookup = row_lookup(param, ids, partitions[layer], dist.group.WORLD)
        (lookup.rows() * grad).sum().backward()
        check.close(f"row_lookup: layer {layer} shard gradient", param.grad, expected_grads[layer], 1e-6)
    check.finish()


if __name__ == "__main__":
    main()
