"""Parallel layouts against single-process references, on CPU with gloo and 2 processes."""

import pytest

from tests.helpers.torchrun_util import every_check_passed, torchrun

pytestmark = pytest.mark.distributed


def test_memory_branches_tp2_with_and_without_sp_match_plain_modules():
    out = torchrun("check_memory_tp.py")
    every_check_passed(out)


@pytest.mark.parametrize("tables", ["replicated", "rows"])
def test_memory_branch_context_parallel_matches_plain_module(tables):
    out = torchrun("check_memory_cp.py", "--tables", tables)
    every_check_passed(out)


@pytest.mark.parametrize("a, b, extra", [
    ("2,1,0", "1,1,0", []),                                            # TP=2 -> TP=1
    ("1,1,0", "2,1,0", []),                                            # TP=1 -> TP=2
    ("2,1,1", "1,1,0", ["--recompute", "full"]),                       # TP=2 + SP + full recompute
    ("1,2,0", "1,1,0", []),                                            # PP=2 -> PP=1
    ("1,1,0", "1,2,0", ["--recompute", "full"]),                       # PP=1 (recompute) -> PP=2
    ("2,1,1", "1,1,0", ["--memory", "placement=before_ffn"]),
    ("2,1,1", "1,1,0", ["--memory", "placement=inside_ffn"]),
    ("2,1,0", "1,1,0", ["--memory", "placement=inside_ffn;gate=scalar"]),
    ("2,1,1", "1,1,0", ["--memory", "kind=engram;gate=none;memory_dim=24"]),
], ids=["tp2-tp1", "tp1-tp2", "sp-recompute", "pp2-pp1", "pp1-pp2", "before_ffn", "inside_ffn-sp",
        "inside_ffn-scalar", "engram-sp"])
def test_gpt_layouts_match_through_resharded_checkpoints(tmp_path, a, b, extra):
    out = torchrun("check_gpt_parallel.py", "--a", a, "--b", b, "--ckpt", str(tmp_path), *extra)
    every_check_passed(out)


@pytest.mark.skipif(not __import__("fe_megatron.megatron.compat", fromlist=["compat"]).has_hybrid_model(),
                    reason="megatron-core has no HybridModel here (0.19 on); `make test-newest` runs this test")
@pytest.mark.parametrize("a, b", [("2,1,0", "1,1,0"), ("2,1,1", "1,1,0"), ("1,2,0", "1,1,0")],
                         ids=["tp2-tp1", "tp2-sp", "pp2-pp1"])
def test_hybrid_layouts_with_memory_match_through_resharded_checkpoints(tmp_path, a, b):
    """The hybrid model with memory (a '*-' pair per GPT layer, memory before the attention of blocks 1 and
    2): the same losses, sparsity term, gradients and parameters at TP=2 (with and without SP) and PP=2
    (the memory on both stages) as at one process, within 1e-5."""
    out = torchrun("check_gpt_parallel.py", "--a", a, "--b", b, "--ckpt", str(tmp_path), "--model", "hybrid")
    every_check_passed(out)
