"""`fe_megatron.megatron_lm.arguments.refused_with_stores`: what the tables' stores cannot run beside is
refused at start-up by the flags that ask for it, with what works instead."""

import argparse

from fe_megatron.megatron_lm.arguments import refused_with_stores

# Megatron-LM's Llama-3 recipe under Megatron-FSDP, as far as the stores look at it
LLAMA3_FSDP = dict(fp16=False, loss_scale=None, save="runs/x", load="runs/x", ckpt_format="fsdp_dtensor",
                   use_megatron_fsdp=True, non_persistent_save_interval=None, data_parallel_random_init=False,
                   use_layer_wise_distributed_optimizer=False, use_torch_fsdp2=False,
                   init_model_with_meta_device=False, lr=1.5e-4, min_lr=1e-5, decoupled_lr=5e-4,
                   decoupled_min_lr=4.5e-5)


def refused(**changes) -> list:
    return refused_with_stores(argparse.Namespace(**{**LLAMA3_FSDP, **changes}))


def test_decoupled_rates_equal_to_the_others_are_refused_with_what_trains_the_same():
    """With --decoupled-lr equal to --lr (and --decoupled-min-lr to --min-lr, or left to it) megatron-core's
    loader cannot tell the embedding's groups from the others; the message names the flags to drop, not the
    tables' multipliers."""
    assert refused() == []
    for changes in (dict(decoupled_lr=1.5e-4, decoupled_min_lr=1e-5), dict(decoupled_lr=1.5e-4, decoupled_min_lr=None)):
        found = refused(**changes)
        assert len(found) == 1 and found[0].startswith("--decoupled-lr 0.00015"), found
        assert "drop --decoupled-lr and --decoupled-min-lr" in found[0] and "--fe-table" not in found[0], found
    assert refused(decoupled_lr=1.5e-4, decoupled_min_lr=2e-5) == []  # the minimum tells them apart
    assert refused(decoupled_lr=None, decoupled_min_lr=None) == []
