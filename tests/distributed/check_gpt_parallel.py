"""A parallel layout of the FactorEngram GPT against another, through distributed checkpoints.

Run: torchrun --nproc_per_node 2 tests/distributed/check_gpt_parallel.py --a TP,PP,SP --b TP,PP,SP --ckpt DIR

``--model hybrid`` runs the same checks on the hybrid model with memory (`fe_megatron.megatron.
hybrid_model`): a pattern of ``*-`` pairs, one per GPT layer, of the local hybrid stack.

Phase A builds the model in layout A, checks a torch_dist save/load round trip bit for
bit, saves the initial weights, trains 3 SGD steps and saves after steps 1 and 3.
Phase B builds layout B, loads A's initial checkpoint (resharding), trains on the same
batches, and compares within 1e-5 relative (fp32): the per-step LM and sparsity losses,
the gradients of step 1 (moved into layout B through a checkpoint of A's gradients) and
the parameters after step 3. Every DP rank gets the same batches, so the
layouts compute the same function.
"""

import argparse
import os

import torch
import yaml
import torch.distributed as dist

from common import Checker, build_hybrid_model, tiny_memory_config, tiny_transformer_config
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.optimizer import OptimizerConfig
from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
from fe_megatron.megatron.parallel import initialize
from fe_megatron.megatron.step import causal_mask, mean_lm_loss, pop_sparsity_loss, run_microbatches

SEQ, MBS, MICROBATCHES, LR, STEPS = 32, 2, 2, 0.5, 3


def make_batches(vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, vocab, (MBS, SEQ + 1), generator=gen)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                            loss_mask=(torch.rand(MBS, SEQ, generator=gen) > 0.1).float(),
                            position_ids=torch.arange(SEQ).expand(MBS, SEQ), attention_mask=causal_mask(SEQ)))
    return batches


def build(layout, memory_overrides, transformer_overrides, seed, model_kind="gpt"):
    tp, pp, sp = layout
    initialize(tensor_parallel_size=tp, pipeline_parallel_size=pp, seed=seed)
    mc = tiny_memory_config(**memory_overrides)
    cfg = tiny_transformer_config(tp=tp, pp=pp, sp=sp, **transformer_overrides)
    inner = build_hybrid_model(cfg, mc, SEQ) if model_kind == "hybrid" else build_gpt_model(cfg, 128, SEQ, mc)
    with torch.no_grad():  # V and the conv start at zero: perturb them so step 1 reaches every parameter
        for layer in inner.stage_memory_layers:
            layer.memory.value_proj.weight.normal_(std=0.05)
            layer.memory.conv.weight.normal_(std=0.1)
    model = wrap_ddp(inner, cfg)
    opt = build_optimizer([model], OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0,
                                                   clip_grad=0.0))
    connect_schedule_hooks(cfg, [model], opt)
    return model, opt


def save(model, path):
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.module.sharded_state_dict(), path)


def load(model, path):
    state = dist_checkpointing.load(model.module.sharded_state_dict(), path)
    model.module.load_state_dict(state)


def step(model, opt, batches):
    """One train step; returns (lm loss, sparsity loss, gradients after finalize)."""
    model.zero_grad_buffer()
    opt.zero_grad()
    losses = run_microbatches([model], batches, SEQ, MBS, forward_only=False)
    grads = {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
    opt.step()
    return mean_lm_loss(losses), pop_sparsity_loss([model], len(batches)), grads


def save_tensors_as_checkpoint(model, tensors, path):
    """Save ``tensors`` (named like the parameters) in the model's sharded layout."""
    originals = params(model)
    with torch.no_grad():
        for n, p in model.module.named_parameters():
            p.copy_(tensors[n])
    save(model, path)
    with torch.no_grad():
        for n, p in model.module.named_parameters():
            p.copy_(originals[n])


def params(model):
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def teardown():
    parallel_state.destroy_model_parallel()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--memory", default="", help="MemoryConfig overrides, e.g. placement=before_ffn")
    parser.add_argument("--recompute", default="", help="'full': phase A uses full activation recompute, B none")
    parser.add_argument("--model", default="gpt", choices=["gpt", "hybrid"])
    args = parser.parse_args()
    layout = lambda text: tuple(int(x) for x in text.split(","))
    memory = {key: yaml.safe_load(value) for key, value in (item.split("=") for item in args.memory.split(";") if item)}
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1) if args.recompute == "full" else {}
    check = Checker()
    batches = [make_batches(128, 100 + step) for step in range(STEPS)]

    # ---- phase A
    model, opt = build(layout(args.a), memory, recompute, seed=1, model_kind=args.model)
    save(model, f"{args.ckpt}/init")
    teardown()
    other, _ = build(layout(args.a), memory, recompute, seed=2, model_kind=args.model)  # different initial weights
    before = params(other)
    load(other, f"{args.ckpt}/init")
    loaded = params(other)
    teardown()
    model, opt = build(layout(args.a), memory, recompute, seed=1, model_kind=args.model)
    for name, value in params(model).items():
        check.equal(f"round trip {name}", loaded[name], value)
    check.true("round trip changed the weights", any(not torch.equal(before[n], loaded[n]) for n in before))
    losses_a = []
    for index in range(STEPS):
        lm, sparsity, grads = step(model, opt, batches[index])
        losses_a.append((lm, sparsity))
        if index == 0:
            save_tensors_as_checkpoint(model, grads, f"{args.ckpt}/grads1")
    save(model, f"{args.ckpt}/step3")
    teardown()

    # ---- phase B
    model, opt = build(layout(args.b), memory, {}, seed=3, model_kind=args.model)
    load(model, f"{args.ckpt}/init")
    for index in range(STEPS):
        lm, sparsity, grads = step(model, opt, batches[index])
        check.close(f"step {index} lm loss", torch.tensor(lm), torch.tensor(losses_a[index][0]))
        check.close(f"step {index} sparsity loss", torch.tensor(sparsity), torch.tensor(losses_a[index][1]))
        check.true(f"step {index} sparsity loss is positive", sparsity > 0)
        if index == 0:
            grads_b = grads
    final = params(model)
    teardown()
    reference, _ = build(layout(args.b), memory, {}, seed=4, model_kind=args.model)
    load(reference, f"{args.ckpt}/grads1")
    grads_a = params(reference)
    load(reference, f"{args.ckpt}/step3")
    final_a = params(reference)
    for name in final:
        check.close(f"step-1 gradient {name}", grads_b[name], grads_a[name])
        check.close(f"parameter after {STEPS} steps {name}", final[name], final_a[name])
    check.finish()


if __name__ == "__main__":
    main()
