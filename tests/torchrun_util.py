"""Moved to tests/helpers/torchrun_util.py; this module only re-exports it for the tests not yet moved."""

from tests.helpers.torchrun_util import *  # noqa: F401,F403
