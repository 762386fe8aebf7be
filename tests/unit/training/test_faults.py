"""Injected faults (`fe_megatron.training.faults`) fire in a first attempt only, never in a recovery."""

import pytest

from fe_megatron.training import faults


@pytest.mark.parametrize("restarted", [{}, {"SLURM_RESTART_COUNT": "1"}, {"TORCHELASTIC_RESTART_COUNT": "2"}])
def test_faults_fire_in_a_first_attempt_only(monkeypatch, restarted):
    monkeypatch.setenv(faults.ENV, "hang_during_save@8:1, nan_loss@3")
    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in restarted.items():
        monkeypatch.setenv(name, value)
    due = [faults.at("hang_during_save", 8, 1), faults.at("hang_during_save", 8, 0), faults.at("nan_loss", 3, 0),
           faults.at("nan_loss", 4, 0)]
    assert due == ([True, False, True, False] if not restarted else [False] * 4)
