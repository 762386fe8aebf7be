"""The test tiers' own rules (docs/testing.md): a unit test starts no Python process (the guard in
tests/unit/conftest.py), and no test module imports another (what two need is in tests/helpers/)."""

import ast
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tests.unit.conftest import _REFUSED, ProcessInUnitTest


def test_starting_python_in_a_unit_test_is_refused_and_points_to_the_integration_tier(request):
    for command in ([sys.executable, "-c", "pass"], ["bash", "-c", "true"],
                    [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--help"]):
        with pytest.raises(ProcessInUnitTest, match=r"move the test .* under tests/integration/") as refused:
            subprocess.run(command, capture_output=True)
        assert request.node.nodeid in str(refused.value) and command[0] in str(refused.value)
    with pytest.raises(ProcessInUnitTest):
        os.system("true")
    assert len(_REFUSED.pop(request.node.nodeid)) == 4  # else this test would fail as the guard's culprit
    # a program that is not Python (a compiler, a system tool) is a library's business and runs
    assert subprocess.run(["true"]).returncode == 0


def test_no_test_module_imports_another():
    """A test module imports from tests/helpers/ (or takes a fixture); importing another test module
    runs its tests' module-level set-up and ties two tiers together."""
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{os.path.relpath(path, ROOT)}:{node.lineno} imports {module}" for module in modules
                              if module.split(".")[-1].startswith("test_")]
    assert not offenders, "move what they share into tests/helpers/: " + "; ".join(offenders)

