"""Fixtures shared by the tiers (tests/unit, tests/integration), and the newest-stack subset.

Helpers the tests share live in the package tests/helpers; the fixtures of one tier in its own
conftest.py (tests/integration/conftest.py: the row-sharding reference runs)."""

import gzip
import os
import random
import sys
import zlib

# One intra-op thread in every test process and every process a test starts: the two pytest-xdist workers
# share two cores, and torch's default of a thread per core makes each operator wait for a thread the other
# worker holds, spinning meanwhile (a cached-generation test: 5 s of CPU alone, 50 s beside the other
# worker). The tests of multi-threaded code set their thread count themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.paths import CORPUS, STARTUP  # noqa: E402

# Every Python process the tests start (pytest-xdist's workers, torchrun's, fe-pretrain's) runs
# tests/helpers/startup/sitecustomize.py first: megatron-core's jit_fuser is a plain decorator there, which
# saves each process importing torch's compiler stack (about 2.8 s of CPU). So does this process.
_INHERITED_PATH = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
os.environ["PYTHONPATH"] = os.pathsep.join([STARTUP, *_INHERITED_PATH])
if "megatron.core" not in sys.modules:
    import tests.helpers.startup.sitecustomize  # noqa: F401,E402 - installs its import hook

# Without a GPU, Triton kernels run in its interpreter (set before fe_megatron.ops looks for backends).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The subset that `make test-newest` runs on the newest supported stack (docs/compatibility.md): what differs
# between the two ends. megatron-core's internals (the contracts), its layers, models and checkpoints;
# Megatron-LM's own trainer (megatron.training ships from 0.19 on), whose tests also run fe-pretrain's
# Megatron engine at 1 process with exact resume, TP=2, PP=2, DP=2 with row-sharded tables (a sparse update
# rule too) and EP=2, and convert to Hugging Face with equal logits; what the trainer and fe-pretrain's Megatron
# engine patch, undone after their runs, and nothing patched by importing the package (megatron.training's
# modules import only here); the hybrid model (HybridModel, 0.19 on);
# checkpoints across megatron-core releases; DeepSpeed ZeRO-3 at 2 ranks against the Megatron engine and the
# DeepSpeed internals its clipping wraps; torch's side (torch.compile through the memory branch, the kernels'
# torch.library operators, cached generation); the install's CUDA decision; a shutdown that leaves other
# libraries' caches alone. fe-pretrain's and the tables' tests whose code is the same at both ends (its own
# resume, layouts and update rules, DeepSpeed's clipping runs, the conversion runs) run at the oldest end only,
# under `make test`.
NEWEST_STACK_SUBSET = (
    "tests/unit/megatron/test_compat.py",
    "tests/unit/megatron/test_sparsity.py",
    "tests/unit/megatron/test_builder.py",
    "tests/unit/megatron/test_transformer_layer.py",
    "tests/unit/megatron/test_layer_specs.py",
    "tests/unit/megatron/test_cpu_backend.py",
    "tests/unit/megatron_lm/test_trainer_patches.py",
    "tests/unit/test_train.py::test_a_megatron_engine_run_leaves_torch_and_megatron_as_they_were",
    "tests/integration/test_fresh_interpreter.py::test_megatron_lm_spec_module_reads_the_environment",
    "tests/integration/test_fresh_interpreter.py::test_importing_every_module_of_the_package_changes_nothing_global",
    "tests/unit/megatron/test_hybrid_specs.py",
    "tests/unit/megatron/test_hybrid_model.py",
    "tests/unit/test_hybrid_pattern.py",
    "tests/unit/convert/test_megatron_reader.py",
    "tests/integration/test_megatron_parallel.py::test_hybrid_layouts_with_memory_match_through_resharded_checkpoints",
    "tests/integration/test_row_sharding.py::test_the_hybrid_model_s_rows_at_dp2_match_its_whole_tables_at_dp1",
    "tests/integration/test_row_sharding.py::test_a_stage_s_layers_share_one_exchange[2]",
    "tests/integration/test_checkpoint_versions.py",
    "tests/integration/test_install.py",
    "tests/integration/test_deepspeed.py::test_zero_3_matches_the_megatron_engine_and_resumes_exactly",
    "tests/unit/deepspeed/test_clipping.py::test_the_deepspeed_internals_that_clipping_wraps_are_there",
    "tests/unit/hf/test_modeling.py::test_cached_greedy_generation_equals_full_recompute",
    "tests/unit/hf/test_modeling.py::test_torch_compile_runs_through_the_memory_branch_without_graph_breaks",
    "tests/unit/ops/test_kernels.py::test_the_operators_pass_torch_library_opcheck",
    "tests/integration/test_megatron_lm.py",
    "tests/integration/test_megatron_lm_recipes.py",
    "tests/integration/test_megatron_lm_hybrid.py",
    "tests/integration/test_hybrid_train.py",
    "tests/integration/test_fresh_interpreter.py::test_destroying_the_groups_keeps_other_libraries_caches",
    "tests/unit/megatron/test_batch.py::test_megatron_lm_s_batch_carries_the_position_ids_to_the_forward_and_the_"
    "context_parallel_hash",
)


# The make targets run the tests in two pytest-xdist workers (`-n 2 --dist loadgroup`): a test file goes
# to one worker whole, so that its module-scoped fixtures (a trained run, a ZeRO-3 run) are made once.
# Files that share a session-scoped product, or a machine-wide daemon, go to one worker together.
SAME_WORKER = {
    # the session's `reference` runs (tests/integration/conftest.py)
    "tests/integration/test_row_sharding.py": "reference", "tests/integration/test_table_stores.py": "reference",
    "tests/integration/test_table_update.py": "reference",
    # the SLURM clusters share the machine's munged (/run/munge)
    "tests/integration/test_slurm.py": "slurm", "tests/integration/test_multinode.py": "slurm",
}


def _in_newest_stack_subset(nodeid: str, entry: str) -> bool:
    nodeid = nodeid.split("@")[0]  # under --dist loadgroup pytest-xdist adds "@<group>"
    return nodeid == entry or nodeid.startswith(entry + "::") or nodeid.startswith(entry + "[")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Mark `NEWEST_STACK_SUBSET` with ``newest_stack``; under ``-m newest_stack`` an entry that
    matches no collected test (renamed, or removed) is an error, so the subset never shrinks silently.
    Each test gets its pytest-xdist group: its file's, or the one `SAME_WORKER` names."""
    for item in items:
        path = item.nodeid.split("::")[0]
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(SAME_WORKER.get(path, path)))
    matched = set()
    for item in items:
        for entry in NEWEST_STACK_SUBSET:
            if _in_newest_stack_subset(item.nodeid, entry):
                item.add_marker(pytest.mark.newest_stack)
                matched.add(entry)
    if "newest_stack" in (config.getoption("markexpr") or "") and not config.getoption("keyword"):
        missing = [entry for entry in NEWEST_STACK_SUBSET if entry not in matched]
        if missing:
            raise pytest.UsageError(f"tests/conftest.py NEWEST_STACK_SUBSET names tests that do not exist: {missing}")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in the process that hands out the tests
def pytest_xdist_node_collection_finished(node, ids):
    """Under ``--dist loadgroup``, refuse to run unless every test carries its group ("@<group>" after its node
    id, which pytest-xdist adds): without it the groups are ignored, a file's tests are spread over the workers
    and its module-scoped runs are made once on each, silently. pytest 9.2 broke this with pytest-xdist 3.8
    (setup.py pins pytest below 9.2)."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    ungrouped = [nodeid for nodeid in ids if "@" not in nodeid.rpartition("]")[2]]
    if ungrouped:
        import xdist

        pytest.exit(f"pytest-xdist's --dist loadgroup is not in effect: {len(ungrouped)} tests have no group in "
                    f"their node id (first: {ungrouped[0]}); pytest {pytest.__version__} with pytest-xdist "
                    f"{xdist.__version__} ignores xdist_group marks. Install the versions setup.py's [test] extra "
                    "names (make setup), or run in one process: PYTEST_WORKERS=0", returncode=4)


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="show the N tests that used the most CPU, with the processes they started (0: none)")


def _cpu_seconds() -> float:
    """CPU time of this process and of every process it started and waited for (torchrun waits for its
    workers, subprocess.run for its command): what a test costs on a machine whose cores are all busy."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _count_cpu(item):
    start = _cpu_seconds()
    yield
    item.user_properties.append(("cpu_s", _cpu_seconds() - start))


# each phase's CPU goes into its report (so pytest-xdist's workers send it to the process that prints)
pytest_runtest_setup = pytest.hookimpl(hookwrapper=True)(_count_cpu)
pytest_runtest_call = pytest.hookimpl(hookwrapper=True)(_count_cpu)
pytest_runtest_teardown = pytest.hookimpl(hookwrapper=True)(_count_cpu)

_CPU_BY_TEST = {}


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == "cpu_s":
            _CPU_BY_TEST[report.nodeid, report.when] = value


def pytest_terminal_summary(terminalreporter, config):
    count = config.getoption("cpu_durations")
    if not count or not _CPU_BY_TEST:
        return
    total = sum(_CPU_BY_TEST.values())
    terminalreporter.write_sep("=", f"most CPU, {count} of {len(_CPU_BY_TEST)} phases (the test's processes included)")
    for (nodeid, when), seconds in sorted(_CPU_BY_TEST.items(), key=lambda entry: -entry[1])[:count]:
        terminalreporter.write_line(f"{seconds:7.2f}s {when:<8} {nodeid}")
    terminalreporter.write_line(f"{total:7.0f}s of CPU in all the tests' phases")


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different seed per test (a CRC of its name with its parameters, not of its file's path, so that
    a test moved to another file keeps its inputs): random inputs, the same on every run."""
    seed = zlib.crc32(request.node.name.encode())
    random.seed(seed)
    torch.manual_seed(seed)
    yield


@pytest.fixture
def process_group(tmp_path):
    """torch.distributed's default group of this one process (gloo), for code that takes part in collectives."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def cpu_backend():
    """megatron-core on this host (`fe_megatron.megatron.cpu_backend`) for one test that calls megatron-core
    itself without the ``megatron_world`` fixture; undone after it, as a run undoes it when it ends."""
    from fe_megatron.megatron import PatchScope, enable_cpu_backend

    with PatchScope("test") as scope:
        enable_cpu_backend(scope=scope)
        yield


@pytest.fixture(scope="module")
def megatron_world():
    """megatron.core's process groups for one process (gloo, the CPU backend on a CPU machine), for
    tests that build Megatron models in the test process; what `initialize` installs (the CPU backend,
    the tables' gradients into ``main_grad``) is undone by `shutdown` at the module's end."""
    from fe_megatron.megatron.parallel import initialize, shutdown

    saved = dict(os.environ)
    initialize()
    yield
    shutdown()
    os.environ.clear()
    os.environ.update(saved)  # no RANK / MASTER_PORT leaks into later tests' subprocesses


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """A 512-piece tokenizer and an indexed dataset from the first 40 bundled addresses."""
    from fe_megatron.data.cli import main as fe_data

    out = tmp_path_factory.mktemp("data")
    subset = out / "subset.jsonl"
    with gzip.open(CORPUS, "rt") as src, open(subset, "w") as dst:
        for i, line in enumerate(src):
            if i >= 40:
                break
            dst.write(line)
    assert fe_data(["train-tokenizer", "--input", str(subset), "--output-prefix", str(out / "tok"),
                    "--vocab-size", "512"]) == 0
    assert fe_data(["preprocess", "--input", str(subset), "--tokenizer-model", str(out / "tok.model"),
                    "--output-prefix", str(out / "corpus"), "--no-progress"]) == 0
    return dict(tokenizer=str(out / "tok.model"), prefix=str(out / "corpus"), subset=str(subset))


@pytest.fixture(scope="module")
def base_llama(tmp_path_factory, small_data):
    """A small random Llama (grouped-query attention) with a tokenizer, saved as transformers does: the
    base model of the graft tests (tests/unit/convert, tests/integration/test_hf_conversion.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fe_megatron.hf import save_tokenizer

    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    LlamaForCausalLM(config).save_pretrained(directory)
    save_tokenizer(small_data["tokenizer"], str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def converted_directory(tmp_path_factory):
    """``(directory, tokenizer model file)``: a converted directory as ``fe-convert mcore-to-hf`` lays it out
    (config.json with model_type fe_megatron and auto_map to the modeling files, a tiny random model, the
    tokenizer): what the tokenizer's tests load in the test process (tests/unit/hf/test_tokenizer.py) and in a
    fresh interpreter (tests/integration/test_hf_loading.py)."""
    from tests.helpers.tokenizers import converted_model_directory

    return converted_model_directory(tmp_path_factory.mktemp("converted"))
