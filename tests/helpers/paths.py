"""Paths the tests read: the repository, its bundled corpus and configs, and the scripts and data
that stay in ``tests/distributed/`` and ``tests/data/``."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "fe_megatron")
CORPUS = os.path.join(ROOT, "data", "sotu.jsonl.gz")
CONFIG = os.path.join(ROOT, "examples", "configs", "demo_cpu.yaml")
# the scripts torchrun launches, and the checkpoints and files the tests read
DISTRIBUTED = os.path.join(ROOT, "tests", "distributed")
TEST_DATA = os.path.join(ROOT, "tests", "data")
# fe-pretrain (or another entry), then a check that no process group's threads are left to end during Python's exit
ENDS_CLEANLY = os.path.join(DISTRIBUTED, "ends_cleanly.py")
# the sitecustomize.py of every process the tests start (tests/conftest.py puts it on PYTHONPATH)
STARTUP = os.path.join(ROOT, "tests", "helpers", "startup")
