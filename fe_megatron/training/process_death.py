"""Helper processes that must not outlive the trainer that started them.

Kept free of heavy imports: a ``spawn``-started process imports this module, and nothing
else of fe_megatron, to run `die_with_parent`.
"""

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL the calling process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
