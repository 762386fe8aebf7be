"""docs/architecture.md's token's way is what runs: one microbatch's forward and backward through the tiny
Megatron GPT (fp32 tables as the engine's parameter, tables in a store, row-sharded tables), traced with
`sys.setprofile`, visits exactly the project files the document lists for that holder, and the stack from the
batch to the gather is the one it gives (its calls and files)."""

import os
import re
import sys

import pytest
import torch

from tests.helpers.configs import tiny_memory_config
from tests.helpers.megatron import batches, build
from tests.helpers.paths import PACKAGE, ROOT

DOC = os.path.join(ROOT, "docs", "architecture.md")
PREFIX = os.path.join(PACKAGE, "")
# Not compared: the CPU backend's proxies, which stand in for CUDA calls on a machine without one (a GPU does
# not visit them), and the kernel backend the dispatch picks on this machine (`ops/__init__.py` is listed).
MACHINE_DEPENDENT = re.compile(r"megatron/(cpu_backend\.py|compat/cpu\w*\.py)$|ops/(\w+_backend|reference)\.py$")


def documented_way() -> dict:
    """``{holder: set of files}`` and the documented gather stack, from the doc's table between the markers
    ``<!-- token's way -->`` and ``<!-- end of the token's way -->``: rows ``| `file` | holders | ... |``,
    holders ``all`` or a comma-separated list of ``parameter``, ``store``, ``row-sharded``."""
    text = open(DOC).read()
    table = text.split("<!-- token's way -->")[1].split("<!-- end of the token's way -->")[0]
    files = {"parameter": set(), "store": set(), "row-sharded": set()}
    for path, holders in re.findall(r"^\| `([\w/.]+\.py)` \| ([\w, -]+) \|", table, re.M):
        for holder in files if holders.strip() == "all" else [h.strip() for h in holders.split(",")]:
            files[holder].add(path)
    stack = re.search(r"The stack from the batch to the gather[^:]*: (.+?)\.\n", text, re.S).group(1)
    return files, [call.strip("` \n") for call in stack.split("->")]


def run_traced(model) -> tuple:
    """The project files one microbatch's forward and backward visit, and the project frames on the stack
    when the gather kernel's dispatch is called."""
    from fe_megatron.megatron.batch import Microbatch, forward_microbatch
    from fe_megatron.training.losses import masked_mean

    batch = Microbatch.of(batches(1)[0])
    visited, stacks = set(), []

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event != "call" or not path.startswith(PREFIX):
            return
        visited.add(os.path.relpath(path, PACKAGE))
        if frame.f_code.co_name == "gather_rows" and not stacks:
            stacks.append(project_stack(frame))

    sys.setprofile(profile)
    try:
        masked_mean(forward_microbatch(model, batch), batch.loss_mask).backward()
    finally:
        sys.setprofile(None)
    return {path for path in visited if not MACHINE_DEPENDENT.search(path)}, stacks[0] if stacks else None


def project_stack(frame) -> list:
    calls = []
    while frame is not None:
        if frame.f_code.co_filename.startswith(PREFIX):
            calls.append(f"{os.path.relpath(frame.f_code.co_filename, PACKAGE)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return calls[::-1]


def model_with(holder: str):
    from fe_megatron.megatron.table_optimizer import manage_tables
    from fe_megatron.tables.plan import TablePlan
    from fe_megatron.training.config import OptimizerArgs

    torch.manual_seed(0)
    sharding = "rows" if holder == "row-sharded" else "replicated"
    model = build(tiny_memory_config(), table_sharding=sharding)
    if holder != "parameter":
        manage_tables(model, OptimizerArgs(), TablePlan.resolve(placement="host", sharding=sharding), "cpu", 0)
    return model


@pytest.mark.parametrize("holder", ["parameter", "store", "row-sharded"])
def test_the_token_s_way_in_the_architecture_doc_is_the_one_that_runs(megatron_world, holder):
    files, stack = documented_way()
    visited, gather_stack = run_traced(model_with(holder))
    assert visited == files[holder], (f"docs/architecture.md's token's way ({holder} tables) is not what runs:\n"
                                      f"  visited, not listed: {sorted(visited - files[holder])}\n"
                                      f"  listed, not visited: {sorted(files[holder] - visited)}")
    if holder == "parameter":
        assert gather_stack == stack, "the doc's stack from the batch to the gather:\n  " + "\n  ".join(gather_stack)
