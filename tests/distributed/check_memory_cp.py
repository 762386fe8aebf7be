"""Context parallelism (CP=2, load-balanced chunks) of the memory branch against the plain module.

Run: torchrun --nproc_per_node 2 tests/distributed/check_memory_cp.py [--tables rows]
Indices are hashed on the full sequence and then split (hash_then_split_for_context_parallel);
outputs, input gradients and parameter gradients (summed over CP ranks, as the data-and-
context-parallel gradient reduction does) must match within 1e-5 relative in fp32.
"""

import torch
import torch.distributed as dist

from common import Checker, tiny_memory_config, tiny_transformer_config
from fe_megatron.megatron.hasher import MicrobatchHasher, hash_then_split_for_context_parallel
from fe_megatron.megatron.memory_layer import build_memory_branch
from fe_megatron.megatron.parallel import initialize
from fe_megatron.memory import build_memory
from fe_megatron.memory.sharding import shard_state_dict

VARIANTS = [dict(), dict(gate="scalar"), dict(placement="inside_ffn"), dict(kind="engram", gate="none",
                                                                                memory_dim=24)]


def local_chunks(x, rank, size):
    """This CP rank's two load-balanced chunks of a sequence-first tensor."""
    chunks = x.chunk(2 * size, dim=0)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], 0)


def main():
    """Whole tables, then tables row-sharded over the two context-parallel ranks (the memory-parallel
    group is data- times context-parallel); the same checks for both."""
    import argparse

    from megatron.core import parallel_state

    parser = argparse.ArgumentParser()
    parser.add_argument("--tables", choices=["replicated", "rows"], default="replicated")
    tables = parser.parse_args().tables
    initialize(context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    check = Checker()
    for variant in VARIANTS:
        name = f"{variant or 'basis'} tables={tables}"
        mc = tiny_memory_config(**variant)
        cfg = tiny_transformer_config(context_parallel_size=2)
        layer = mc.layers[0]
        torch.manual_seed(5)
        ref = build_memory(mc, layer)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        par = build_memory_branch(cfg, mc, layer, table_sharding=tables)
        check.true(f"{name}: rows sharded over the CP ranks",
                   (par.row_partition is not None) == (tables == "rows"))
        par.load_state_dict(shard_state_dict(ref.state_dict(), mc.kind, 0, 1, par.row_partition))
        store = None
        if par.row_partition is not None:  # row-sharded tables train from a store, as the table plan keeps them
            store = par.tables.manage("device", torch.device("cpu"), partition=par.row_partition,
                                      row_group=par.parallel.memory_parallel_group)
            store.allocate_gradient(torch.float32)
        seq, batch = 48, 2
        h = torch.randn(seq, batch, mc.hidden_size)
        ids = torch.randint(0, mc.vocab_size, (batch, seq))
        weight = torch.randn(seq, batch, mc.output_size)
        hasher = MicrobatchHasher(mc, [layer])

        h_ref = h.clone().requires_grad_()
        m_ref, _ = ref(h_ref.transpose(0, 1), lookup=ref.start_lookup(hasher.hasher.indices_per_layer(ids)[layer]))
        (m_ref.transpose(0, 1) * weight).sum().backward()

        h_par = local_chunks(h, rank, size).requires_grad_()
        idx = hash_then_split_for_context_parallel(hasher, ids, size, rank)[layer]
        m_par, _ = par(h_par, lookup=par.start_lookup(idx))
        (m_par * local_chunks(weight, rank, size)).sum().backward()
        check.close(f"{name}: output", m_par, local_chunks(m_ref.transpose(0, 1), rank, size))
        if h_ref.grad is not None:
            check.close(f"{name}: input grad", h_par.grad, local_chunks(h_ref.grad, rank, size))
        ref_grads = shard_state_dict({n: p.grad for n, p in ref.named_parameters()}, mc.kind, 0, 1, par.row_partition)
        for n, p in par.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            check.close(f"{name}: grad {n}", grad, ref_grads[n])
        if store is not None:  # the row exchange delivered every rank's gradient of its rows to their owner
            check.close(f"{name}: grad tables.weight (this rank's rows)", store.main_grad, ref_grads["tables.weight"])
    check.finish()


if __name__ == "__main__":
    main()
