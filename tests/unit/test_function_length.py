"""No function of the package is longer than `MAX_LINES` lines: a longer one is split into helpers
named for what each part does (parse, validate, build, run, report).

A function's length runs from its ``def`` line to its last line, docstring included and decorators
excluded; nested functions and methods count on their own (and inside the function that holds them)."""

import ast
import os

from tests.helpers.paths import PACKAGE, ROOT

MAX_LINES = 60


def long_functions(max_lines: int = MAX_LINES) -> list:
    """``path:line name (N lines)`` of every function in the package longer than ``max_lines``."""
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as fh:
                tree = ast.parse(fh.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > max_lines:
                        found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return sorted(found)


def test_no_function_is_longer_than_the_limit():
    found = long_functions()
    assert not found, (f"{len(found)} function(s) longer than {MAX_LINES} lines; split each into helpers:\n  "
                       + "\n  ".join(found))
