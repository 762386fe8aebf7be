"""One stage's row exchange (`fe_megatron.tables.row_exchange.StageRowExchange`) against each layer
exchanging alone (`row_lookup`) and against whole tables, on fresh random tables, ids and gradients.

Run: torchrun --nproc_per_node N tests/distributed/check_stage_exchange.py

Three layers with different table layouts (their own branch sizes), each rank looking up its own
random ids (with repeats), from shards in `TableStore`s (dense gradients, and gradients kept by row
as the sparse rules keep them): the rows equal the whole tables' rows, and after backward every
rank's shard gradient equals its rows of the whole tables' gradient summed over all ranks' lookups.
The exchange issues 3 all-to-alls in forward and 1 in backward for all three layers, and each
layer exchanged alone gives the same gradients.

Node-shared shards (`fe_megatron.tables.node_shared`, ranks 0-1 one node, rank 2 another) give the same
rows and gradients; a rank reads its node's rows from the node's segment (no rows cross inside a node, and
with one node the rows' all-to-all is not issued), sees a node mate's update at its next lookup, and the
segment files are gone from the folder once mapped.
"""

import os
import tempfile


import torch
import torch.distributed as dist

from common import Checker
from fe_megatron.tables.row_exchange import RowPartition, StageRowExchange, row_lookup
from fe_megatron.tables.node_shared import PREFIX, share_node_rows
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

    folder = tempfile.mkdtemp(prefix="fe-node-shared-") if rank == 0 else None
    holder = [folder]
    dist.broadcast_object_list(holder)
    folder = holder[0]

    def stores(kind: str) -> list:
        out = []
        for partition, whole in zip(partitions, wholes):
            store = TableStore(partition.take(whole).clone(), "host" if kind == "node" else "device")
            if kind == "rows":
                store.allocate_row_gradients()
            else:
                store.allocate_gradient(torch.float32)
            out.append(store)
        if kind == "node":  # ranks 0-1 share a node, rank 2 is another
            share_node_rows(out, partitions, dist.group.WORLD, folder, key=f"node{rank // 2}")
        return out

    def gradient(store) -> torch.Tensor:
        store.wait_for_gradients()  # host stores add on their worker thread
        if store.main_grad is not None:
            return store.main_grad
        ids, rows = store.row_gradients.coalesce()
        return torch.zeros(store.weight.shape).index_add_(0, ids, rows)

    nodes = (world + 1) // 2
    for kind in ("dense", "rows", "node"):
        sources = stores(kind)
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
        issued = 2 if kind == "node" and nodes == 1 else 3
        check.true(f"{kind}: {issued} all-to-alls in forward for 3 layers (got {forward})", forward == issued)
        check.true(f"{kind}: 1 in backward (got {backward})", backward == 1)
        for layer, store in enumerate(sources):
            check.close(f"{kind}: layer {layer} shard gradient", gradient(store), expected_grads[layer], 1e-6)
        if kind == "node":
            node_mates = [r for r in range(world) if r // 2 == rank // 2]
            served = sum(n for r, n in enumerate(exchange.recv_split) if r not in node_mates)
            check.true(f"node: rows go only to other nodes' ranks ({exchange.rows_moved})",
                       exchange.rows_moved["forward_out"] == served)
            check.true("node: the segment files are gone from the folder once mapped",
                       not [name for name in os.listdir(folder) if name.startswith(PREFIX)])
            # an owner's update is what its node mates (and other nodes) read at their next lookup
            for store in sources:
                store.weight.mul_(2.0)
            dist.barrier()
            again = StageRowExchange(sources, [ids for ids, _ in mine], partitions, dist.group.WORLD)
            for layer, (ids, _) in enumerate(mine):
                check.equal(f"node: layer {layer} rows after every owner's update", again.layer_lookup(layer).rows(),
                            2.0 * wholes[layer][ids])

    # the same gradients through each layer's own exchange, for comparison
    for layer, (store, (ids, grad)) in enumerate(zip(stores("dense"), mine)):
        lookup = row_lookup(store, ids, partitions[layer], dist.group.WORLD)
        (lookup.rows() * grad).sum().backward()
        check.close(f"row_lookup: layer {layer} shard gradient", store.main_grad, expected_grads[layer], 1e-6)
    # ranks that share a node's name but not its folder (containers with their own /dev/shm) are refused on
    # every rank, and no file is left behind
    own_folder = tempfile.mkdtemp(prefix=f"fe-node-shared-{rank}-")
    try:
        share_node_rows([TableStore(partition.take(whole).clone(), "host") for partition, whole in
                         zip(partitions, wholes)], partitions, dist.group.WORLD, own_folder, key="one-name")
        check.true("a node name shared without the folder is refused", world == 1)
    except RuntimeError as err:
        check.true(f"a node name shared without the folder is refused on every rank ({err})",
                   world > 1 and "node-shared tables: rank" in str(err))
    check.true("no file left in the rank's own folder", os.listdir(own_folder) == [])
    shard = torch.nn.Parameter(partitions[0].take(wholes[0]).clone())
    try:
        row_lookup(shard, mine[0][0], partitions[0], dist.group.WORLD)
        check.true("a parameter as a shard is refused", False)
    except TypeError as err:
        check.true(f"a parameter as a shard is refused by name ({err})", "layer 0's shard is a Parameter" in str(err))
    check.finish()


if __name__ == "__main__":
    main()
