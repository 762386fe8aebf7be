"""The GPU tier's fixtures: one `Checker` (one results folder and time budget) for the session, and the
steps' shared products (the kernels built, the data, the shared initial weights), each made once.

Set by `make gpu-check` and `make gpu-check-dry` (environment variables, so that `pytest tests` needs
none of them): ``FE_GPU_CHECK_OUT`` (the results folder, default ``gpu_results``),
``FE_GPU_CHECK_BUDGET_S`` (seconds for the whole check), ``FE_GPU_CHECK_DRY=1`` (on CPU, tiny) and
``FE_GPU_CHECK_TRAIN_STEPS``."""

import os

import pytest

from tests.gpu import check


@pytest.fixture(scope="session")
def target() -> check.Target:
    return check.Target.from_environment()


@pytest.fixture(scope="session")
def checker(target) -> check.Checker:
    budget = os.environ.get("FE_GPU_CHECK_BUDGET_S")
    out = os.path.abspath(os.environ.get("FE_GPU_CHECK_OUT", "gpu_results"))
    os.makedirs(out, exist_ok=True)
    c = check.Checker(out, float(budget) if budget else None, dry=target.dry)
    yield c
    c.write()
    print("\n" + check.summary(c))


def outcome(c: check.Checker, name: str, step) -> dict:
    """Run ``step()`` (which records its entry); a spent budget records the step as not run."""
    try:
        return step()
    except check.BudgetSpent:
        return c.not_run(name, "the time budget was spent before it ended")


def require(entry: dict) -> None:
    """Pass, fail or skip the test by the step's recorded status."""
    if entry["status"] == "not run":
        pytest.skip(f"{entry['step']}: not run: {entry.get('why', '')}")
    assert entry["status"] == "pass", f"{entry['step']}: {entry.get('why', 'failed')} (log: {entry.get('log')})"


@pytest.fixture(scope="session")
def built(checker, target) -> dict:
    """The kernels built in place (the CUDA ones on a GPU; C++ in a dry run): the build step's entry."""
    return outcome(checker, "build", lambda: check.build(checker, target))


@pytest.fixture
def kernels(built):
    if built["status"] != "pass":
        pytest.skip(f"needs the kernels, and the build step did not pass: {built.get('why', built['status'])}")


@pytest.fixture(scope="session")
def data(checker) -> tuple:
    """``(tokenizer model, dataset prefix)`` made from the bundled corpus."""
    try:
        tokenizer, prefix = check.prepare_data(checker)
    except check.BudgetSpent:
        pytest.skip("the time budget was spent before the data was made")
    if tokenizer is None:
        pytest.fail("the data could not be made (logs/data.log)")
    return tokenizer, prefix


@pytest.fixture(scope="session")
def start(checker, data) -> tuple:
    """``(Hugging Face directory, Megatron checkpoint)`` of one set of initial weights."""
    try:
        hf, mcore = check.start_weights(checker, *data)
    except check.BudgetSpent:
        pytest.skip("the time budget was spent before the shared initial weights were made")
    if mcore is None:
        pytest.fail("the shared initial weights could not be made (logs/start-weights.log)")
    return hf, mcore


@pytest.fixture(scope="session")
def pretrain_runs(checker, target, built, data, start) -> tuple:
    """The pretrain step: ``(entry, the GPU fp32 run's directory or None)``."""
    if built["status"] != "pass":
        return checker.not_run("pretrain", "the kernels were not built"), None
    try:
        return check.pretrain(checker, target, *data, start[1])
    except check.BudgetSpent:
        return checker.not_run("pretrain", "the time budget was spent before it ended"), None
