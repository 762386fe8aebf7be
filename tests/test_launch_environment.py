"""The launcher's environment seen by a worker: injected faults stay out of a recovery, and a job
whose hosts would advertise loopback addresses to each other is refused before it connects."""

import pytest

from fe_megatron.training import distributed, faults


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


@pytest.mark.parametrize("env, spans", [
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, True),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, False),
    ({"SLURM_JOB_NUM_NODES": "2"}, True),
    ({}, False),
])
def test_a_job_spans_hosts_by_torchruns_or_slurms_counts(monkeypatch, env, spans):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert distributed._spans_hosts() is spans


def test_a_host_name_resolving_to_loopback_is_refused_across_hosts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(distributed, "_own_address", lambda: "")
    with pytest.raises(RuntimeError, match="does not resolve to an address.* Set GLOO_SOCKET_IFNAME"):
        distributed.refuse_loopback_across_hosts()
    monkeypatch.setattr(distributed, "_own_address", lambda: "127.0.1.1")
    with pytest.raises(RuntimeError, match=r"resolves to 127\.0\.1\.1: gloo would give its peers a loopback address. "
                                           r"Set GLOO_SOCKET_IFNAME"):
        distributed.refuse_loopback_across_hosts()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # named: gloo binds there, whatever the name resolves to
    distributed.refuse_loopback_across_hosts()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one host: loopback is right
    distributed.refuse_loopback_across_hosts()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(distributed, "_own_address", lambda: "10.1.2.3")
    distributed.refuse_loopback_across_hosts()
