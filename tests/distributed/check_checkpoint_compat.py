"""A checkpoint written by release 0.1.0 loads into today's model and computes what 0.1.0 computed.

Run: torchrun --nproc_per_node N tests/distributed/check_checkpoint_compat.py --name factorengram_tp2 --tp N
Loads ``tests/data/checkpoint_v0_1_0/<name>`` (model, optimizer, LR schedule, iteration) through
fe-pretrain's own ``load_checkpoint`` at tensor-parallel size ``--tp`` (resharding when it differs
from the size it was saved at), then compares the mean LM loss on the recorded probe batch with
the value release 0.1.0 recorded right after saving, then takes one more optimizer step and
compares the loss after it with 0.1.0's (which needs the saved Adam state and LR schedule).
"""

import argparse
import json
import os

import torch

from common import Checker, tiny_memory_config, tiny_transformer_config
from fe_megatron.megatron.builder import build_gpt_model, build_optimizer, connect_schedule_hooks, wrap_ddp
from fe_megatron.checkpoint.commit import find_checkpoint  # noqa: E402
from fe_megatron.megatron.checkpointing import load_checkpoint
from fe_megatron.megatron.parallel import initialize
from fe_megatron.megatron.step import causal_mask, train_step

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "checkpoint_v0_1_0")


def main():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    initialize(tensor_parallel_size=args.tp, seed=123)  # a different seed from the one that wrote it
    overrides = dict(kind="engram", gate="scalar", memory_dim=24) if args.name.startswith("engram") else {}
    mc = tiny_memory_config(num_layers=2, layers=[0, 1], **overrides)
    cfg = tiny_transformer_config(tp=args.tp, num_layers=2)
    model = build_gpt_model(cfg, 128, 32, mc)
    ddp = wrap_ddp(model, cfg)
    opt = build_optimizer([ddp], OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01,
                                                 clip_grad=1.0), table_lr_mult=2.0,
                          table_weight_decay_mult=0.0)  # release 0.1.0's default, which wrote the fixture
    connect_schedule_hooks(cfg, [ddp], opt)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1,
                                    lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=10, wd_incr_style="constant")
    check = Checker()
    iteration = load_checkpoint(find_checkpoint(os.path.join(DATA, args.name)), [ddp], opt, sched)
    record = json.load(open(os.path.join(DATA, f"{args.name}.json")))
    check.true(f"iteration {iteration} == {record['iteration']}", iteration == record["iteration"])
    tokens, labels = torch.tensor(record["tokens"]), torch.tensor(record["labels"])
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)

    def probe_loss():
        model.eval()
        with torch.no_grad():
            loss = model(tokens, position_ids, causal_mask(tokens.shape[1]), labels=labels).float().mean()
        model.train()
        return loss

    name = f"{args.name} at TP={args.tp}"
    check.close(f"{name}: loss on the recorded batch", probe_loss(), torch.tensor(record["lm_loss"]))
    batch = dict(tokens=tokens, labels=labels, loss_mask=torch.ones_like(tokens, dtype=torch.float),
                 position_ids=position_ids, attention_mask=causal_mask(tokens.shape[1]))
    _, sparsity, grad_norm, ok = train_step([ddp], opt, [batch], tokens.shape[1], tokens.shape[0])
    sched.step(increment=1)
    check.true(f"{name}: a step after loading (sparsity {sparsity}, grad norm {grad_norm})",
               ok and sparsity > 0 and float(grad_norm) > 0)
    # the step used the saved Adam moments, step count and LR schedule, as 0.1.0's own next step did
    check.close(f"{name}: loss after one more step", probe_loss(),
                torch.tensor(record["lm_loss_after_one_more_step"]))
    check.finish()


if __name__ == "__main__":
    main()
