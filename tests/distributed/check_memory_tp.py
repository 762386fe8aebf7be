"""The memory branch at TP=2 (with and without sequence parallelism) against the same class in
one process.

Run: torchrun --nproc_per_node 2 tests/distributed/check_memory_tp.py
A single-process module's state dict is split into the TP ranks' shards and gathered back
through the sharding plan alone (bit for bit); a branch built at TP=2 from the same seed holds
exactly those shards. Then forward outputs, the L1 term, input gradients, gathered parameter
gradients and parameters after 4 Adam steps agree within 1e-5 relative in fp32.
"""

import os

import torch
import torch.distributed as dist

from common import Checker, tiny_memory_config, tiny_transformer_config
from fe_megatron.megatron.memory_layer import build_memory_branch
from fe_megatron.megatron.parallel import initialize
from fe_megatron.memory import build_memory
from fe_megatron.memory.sharding import shard_state_dict, unshard_state_dicts
from fe_megatron.ngram import NgramHasher

VARIANTS = [dict(), dict(gate="scalar"), dict(gate="none"), dict(placement="inside_ffn"),
            dict(kind="engram", gate="scalar", memory_dim=24),
            dict(kind="engram", gate="none", memory_dim=24)]
# Engram's sqrt-sign gate has derivative 1/(2 sqrt|g|): where a score lands near 0 it turns
# last-bit differences of the TP partial sums into 1e-4 relative gradient differences after
# a few Adam steps in fp32. Checked in float64 instead, where the same code agrees to 1e-10.
FLOAT64_VARIANTS = {4}


def gather_seq(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, 0)


def run_variant(check: Checker, variant: dict, sp: bool, dtype=torch.float32):
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    name = f"{variant or 'basis'} sp={sp} {dtype}"
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    mc = tiny_memory_config(**variant)
    cfg = tiny_transformer_config(tp=tp, sp=sp)
    layer = mc.layers[0]
    torch.manual_seed(11)  # identical on every rank: the reference and the inputs
    ref = build_memory(mc, layer)
    ref.reset_parameters(seed=99)
    par = build_memory_branch(cfg, mc, layer, group)
    par.reset_parameters(seed=99)
    mine = shard_state_dict(ref.state_dict(), mc.kind, rank, tp)
    for n, value in par.state_dict().items():  # initialization does not depend on the layout
        check.equal(f"{name}: initial {n} is the TP={tp} slice of the single-process one", value, mine[n])
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)  # non-trivial everywhere, the conv included
    shards = [None] * tp
    dist.all_gather_object(shards, shard_state_dict(ref.state_dict(), mc.kind, rank, tp), group=group)
    for n, value in unshard_state_dicts(shards, mc.kind).items():
        check.equal(f"{name}: {n} split and gathered through the plan", value, ref.state_dict()[n])
    par.load_state_dict(shards[rank])
    ref, par = ref.to(dtype), par.to(dtype)

    seq, batch = 32, 3
    h = torch.randn(seq, batch, mc.hidden_size, dtype=dtype)
    ids = torch.randint(0, mc.vocab_size, (batch, seq))
    out_weight = torch.randn(seq, batch, mc.output_size, dtype=dtype)
    l1_weight = torch.randn(seq, batch, dtype=dtype)
    idx = NgramHasher(mc, layer).indices(ids)  # [b, s, nb]
    chunk = slice(rank * seq // tp, (rank + 1) * seq // tp) if sp else slice(None)

    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    par_opt = torch.optim.Adam(par.parameters(), lr=1e-2)
    for step in range(4):
        h_ref = h.clone().requires_grad_()
        m_ref, l1_ref = ref(h_ref.transpose(0, 1), lookup=ref.start_lookup(idx))
        m_ref, l1_ref = m_ref.transpose(0, 1), l1_ref.t()
        ((m_ref * out_weight).sum() + (l1_ref * l1_weight).sum()).backward()

        h_par = h[chunk].clone().requires_grad_()
        m_par, l1_par = par(h_par, lookup=par.start_lookup(idx.transpose(0, 1).contiguous()))
        ((m_par * out_weight[chunk]).sum() + (l1_par * l1_weight).sum()).backward()
        for p in par.parameters():  # what finalize_model_grads does for sequence-parallel params
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=group)

        l1_sum = l1_par.detach().clone()
        dist.all_reduce(l1_sum, group=group)
        m_full = gather_seq(m_par.detach(), group) if sp else m_par.detach()
        check.close(f"{name} step {step}: output", m_full, m_ref, tol)
        check.close(f"{name} step {step}: l1", l1_sum, l1_ref, tol)
        if mc.gate == "none":  # the branch reads no hidden state
            check.true(f"{name}: no input grad", h_par.grad is None and h_ref.grad is None)
        else:
            h_grad = gather_seq(h_par.grad, group) if sp else h_par.grad
            check.close(f"{name} step {step}: input grad", h_grad, h_ref.grad, tol)
        grads = [None] * tp
        dist.all_gather_object(grads, {n: p.grad.detach() for n, p in par.named_parameters()}, group=group)
        full_grads = unshard_state_dicts(grads, mc.kind)
        for n, p in ref.named_parameters():
            check.close(f"{name} step {step}: grad {n}", full_grads[n], p.grad, tol)
        ref_opt.step(), par_opt.step()
        ref_opt.zero_grad(), par_opt.zero_grad()
    shards = [None] * tp
    dist.all_gather_object(shards, {n: p.detach() for n, p in par.state_dict().items()}, group=group)
    for n, value in unshard_state_dicts(shards, mc.kind).items():
        check.close(f"{name}: {n} after 4 Adam steps", value, ref.state_dict()[n], tol)


def main():
    initialize(tensor_parallel_size=2)
    check = Checker()
    only = os.environ.get("FE_CHECK_ONLY")  # e.g. "0:1" runs VARIANTS[0] with sp=True, for debugging
    for i, variant in enumerate(VARIANTS):
        for sp in (False, True):
            if only is None or only == f"{i}:{int(sp)}":
                run_variant(check, variant, sp, torch.float64 if i in FLOAT64_VARIANTS else torch.float32)
    check.finish()


if __name__ == "__main__":
    main()
