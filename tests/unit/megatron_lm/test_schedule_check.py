"""`fe_megatron.megatron_lm.run.schedule_problems`: what megatron-core's `OptimizerParamScheduler` would stop
on with a bare ``assert self.lr_warmup_steps < self.lr_decay_steps`` is refused at start-up by both flags."""

import argparse

from fe_megatron.megatron_lm.run import schedule_problems

SCHEDULE = dict(train_iters=None, train_samples=None, lr_decay_iters=None, lr_decay_samples=None,
                lr_warmup_iters=0, lr_warmup_samples=0, lr_warmup_fraction=None, global_batch_size=8, lr=3e-4,
                min_lr=3e-5, lr_warmup_init=0.0)


def problems(**changes) -> list:
    return schedule_problems(argparse.Namespace(**{**SCHEDULE, **changes}))


def test_a_warm_up_as_long_as_the_decay_is_refused_by_both_flags():
    found = problems(train_samples=4096, lr_warmup_samples=2048, lr_decay_samples=2048)
    assert len(found) == 1 and "--lr-warmup-samples 2048 with --lr-decay-samples 2048" in found[0], found
    found = problems(train_iters=100, lr_warmup_iters=100)  # the decay defaults to --train-iters
    assert len(found) == 1 and "--lr-warmup-iters 100 with --train-iters (the decay's default) 100" in found[0]
    found = problems(train_iters=100, lr_decay_iters=50, lr_warmup_fraction=1.0)
    assert len(found) == 1 and "--lr-warmup-fraction 1.0 with --lr-decay-iters 50" in found[0], found


def test_the_rates_and_an_empty_decay_are_refused_by_their_flags():
    assert problems(train_samples=4096, lr_decay_samples=0)[0].startswith("--lr-decay-samples 0:")
    found = problems(train_iters=100, min_lr=1e-3, lr_warmup_init=1.0)
    assert [problem.split(":")[0] for problem in found] == ["--min-lr 0.001 with --lr 0.0003",
                                                            "--lr-warmup-init 1.0 with --lr 0.0003"], found


def test_a_schedule_megatron_core_takes_is_not_refused():
    assert problems(train_iters=100, lr_warmup_iters=99) == []
    assert problems(train_samples=4096, lr_warmup_samples=100, lr_decay_samples=2048) == []
    assert problems(train_iters=100, lr_warmup_fraction=0.5) == []
