"""`destroy_process_groups` ends the groups and nothing else: it runs inside processes that go on
(fe-convert's hf-to-mcore, a test), so the caches and registries of other libraries must survive it."""

import subprocess
import sys
import textwrap

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
