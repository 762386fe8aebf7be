"""The DeepSpeed engine's test runs (tests/unit/deepspeed, tests/integration/test_deepspeed.py): the
demo config at test size, clipping at every step."""

from tests.helpers.training import small_overrides

STEPS = 4
CLIP = 0.3  # below every step's gradient norm (0.5-0.9 here): every run here clips at every step


def overrides(data, **extra):
    values = {"training.train_steps": STEPS, "training.log_interval": 1, "training.eval_interval": STEPS,
              "training.eval_steps": 1, "training.save_interval": 2, "optimizer.warmup_steps": 1,
              "optimizer.lr": 1e-2, "optimizer.clip_grad": CLIP}
    values.update(extra)
    return small_overrides(data, **values)
