"""The unit tier's rule: a unit test runs in the test process and starts no Python process of its own.

A Python process costs seconds (torch and megatron-core are imported again) and a torchrun launch
more, so the tests that start one belong to the integration tier, where their cost is budgeted
(docs/testing.md). While a unit test runs, an audit hook watches every process start
(``subprocess.Popen``, ``os.system``, ``os.posix_spawn``, ``os.exec*``); one that starts a Python
interpreter, a Python console script (fe-pretrain, torchrun, deepspeed, ...) or a shell command is
refused before it starts, and the test fails with a message that points to ``tests/integration/``.
Processes that a library starts for itself without these calls (megatron-core's checkpoint
``Manager``, a compiler) are not the test's launches and are left alone.
"""

import os
import shutil
import sys

import pytest

# the unit test running now (its node id), while it runs; the hook is idle otherwise
_RUNNING = []
# what each unit test tried to start: {node id: [command, ...]}
_REFUSED = {}
UNIT_TIER = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _is_unit_test(item) -> bool:
    """pytest calls a conftest's run-test hooks for every test of the session (`pytest tests`), not only
    for those below its folder."""
    return str(item.path).startswith(UNIT_TIER)


class ProcessInUnitTest(RuntimeError):
    """A unit test started a Python process: it belongs in tests/integration/."""


def _program(argv) -> str:
    if isinstance(argv, (str, bytes)):
        argv = os.fsdecode(argv).split()
    return os.fsdecode(argv[0]) if argv else ""


SHELLS = ("sh", "bash", "dash", "zsh")


def starts_python(program: str) -> bool:
    """Whether ``program`` (a path or a name on PATH) is a Python interpreter, a script run by one, or a
    shell (whose command may start either: launch_scripts/*.sh)."""
    name = os.path.basename(program)
    if name.startswith("python") or name in SHELLS:
        return True
    path = shutil.which(program) or program
    try:
        with open(path, "rb") as fh:
            first = fh.readline(256)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def refusal(nodeid: str, command: str) -> str:
    return (f"{nodeid} started a process ({command[:200]}): a unit test runs in the test process and starts "
            f"no Python process, torchrun or shell command. Call the code in-process (a command's main(argv)), "
            f"or move the test to the integration file of its capability under tests/integration/ "
            f"(docs/testing.md, 'Adding a test').")


def _audit(event: str, args: tuple) -> None:
    if not _RUNNING:
        return
    if event == "subprocess.Popen":
        program, command = _program(args[1]) if args[0] is None else os.fsdecode(args[0]), args[1]
        refused = starts_python(program)
    elif event in ("os.posix_spawn", "os.exec"):
        program, command = os.fsdecode(args[0]), args[1]
        refused = starts_python(program)
    elif event == "os.system":
        command, refused = args[0], True
    else:
        return
    if refused:
        text = os.fsdecode(command) if isinstance(command, (str, bytes)) else \
            " ".join(os.fsdecode(part) for part in command)
        _REFUSED.setdefault(_RUNNING[-1], []).append(text)
        raise ProcessInUnitTest(refusal(_RUNNING[-1], text))


sys.addaudithook(_audit)  # an audit hook cannot be removed; it acts only while a unit test runs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The hook watches the test's set-up (its fixtures), call and tear-down."""
    if not _is_unit_test(item):
        yield
        return
    _RUNNING.append(item.nodeid)
    try:
        yield
    finally:
        _RUNNING.pop()
        _REFUSED.pop(item.nodeid, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A refused start fails the test even where the test caught the error."""
    outcome = yield
    report = outcome.get_result()
    started = _REFUSED.pop(item.nodeid, None) if _is_unit_test(item) else None
    if started and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = refusal(item.nodeid, started[0])
