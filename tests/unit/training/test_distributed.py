"""The launcher's environment seen by a worker (`fe_megatron.training.distributed`): a job whose hosts would
advertise loopback addresses to each other is refused before it connects, and destroying the process
groups leaves other libraries' caches alone."""

import subprocess
import sys
import textwrap

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


SCRIPT = textwrap.dedent("""
    import functools, socket, threading
    import torch, torch.distributed as dist
    import torch._dynamo as dynamo  # before: it fills its registries when imported
    from fe_megatron.training.distributed import destroy_process_groups

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    def square(x):
        return x * x
    square.__module__ = "megatron.core.example"  # as Megatron's rotary embedding: a cache that keeps its arguments
    megatron_cache = functools.lru_cache(square)
    other_cache = functools.lru_cache(lambda x: x + 1)
    megatron_cache(torch.randn(3)), other_cache(2)

    class Holder:
        pass
    holder = Holder()
    holder.group = dist.new_group([0])
    holder.groups = [holder.group, 7]

    destroy_process_groups()

    assert megatron_cache.cache_info().currsize == 0, "Megatron's cache still keeps its arguments"
    assert other_cache.cache_info().currsize == 1, "a cache of another library was emptied"
    assert holder.group is None and holder.groups == [None, 7], (holder.group, holder.groups)
    left = [t.name for t in threading.enumerate() if t.name.startswith(("pt_gloo", "gloo_"))]
    assert not left, left

    # torch.compile keeps its table of polyfills (all(), any(), ...) in a functools.cache
    def all_positive(xs):
        return torch.tensor(1.0) if all(x > 0 for x in xs) else torch.tensor(0.0)
    explain = dynamo.explain(all_positive)([1, 2, 3])
    assert explain.graph_break_count == 0, explain.break_reasons
    print("ok")
""")


def test_destroying_the_groups_keeps_other_libraries_caches():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
