"""`fe_megatron.deepspeed.clipping`: the norms of a step DeepSpeed skipped, and the DeepSpeed internals
that one clipping norm over ZeRO's parameters and the tables wraps."""

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is installed by the project's set-up (make setup)")


def test_a_step_deepspeed_skipped_reports_an_infinite_norm_and_the_tables_clip_by_their_own():
    """Where DeepSpeed computed no norm (ZeRO 1/2 in bf16 skip a step with non-finite gradients before
    it, and report inf), the step's norm stays infinite, so the step is reported and the tables take
    no update; where it did, both parts use the joint norm."""
    import math

    from fe_megatron.deepspeed.clipping import step_norms

    assert step_norms(None, 0.5, math.inf) == (0.5, math.inf)
    assert step_norms(None, 0.3, 0.4) == (0.3, pytest.approx(0.5))
    assert step_norms(0.7, 0.3, 0.7) == (0.7, 0.7)
    assert step_norms(math.inf, 0.3, math.inf) == (math.inf, math.inf)


def test_the_deepspeed_internals_that_clipping_wraps_are_there():
    """One norm over ZeRO's parameters and the tables outside it wraps DeepSpeed's norm functions
    (fe_megatron/deepspeed/clipping.py): a release that moved one fails here, by name."""
    from fe_megatron.deepspeed.clipping import missing_internals

    assert missing_internals() == []
