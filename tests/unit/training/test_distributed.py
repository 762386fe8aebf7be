"""The launcher's environment seen by a worker (`fe_megatron.training.distributed`): a job whose hosts would
advertise loopback addresses to each other is refused before it connects. That destroying the process
groups leaves other libraries' caches alone is tests/integration/test_fresh_interpreter.py's."""

import pytest

from fe_megatron.training import distributed


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
