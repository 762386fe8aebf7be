"""The closest known name to a mistyped one, for error messages: ``training.trian_steps`` is
answered with ``did you mean training.train_steps?`` rather than with the list of every field.

Only the standard library: any layer may use it (the core, the command lines, Megatron-LM's
``--fe-*`` flags)."""

from __future__ import annotations

import difflib
from typing import Iterable

# A list of known names this long or shorter is still printed beside the suggestion.
SHORT_LIST = 10


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean PREFIX+CLOSEST?"`` for the known name closest to ``name`` (difflib's
    ratio at least 0.6, letter case ignored), ``""`` when none is that close."""
    known = sorted({str(k) for k in known})
    by_lower = {k.lower(): k for k in known}
    matches = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1)
    return f"; did you mean {prefix}{by_lower[matches[0]]}?" if matches else ""


def unknown_name(what: str, name: str, known: Iterable[str], prefix: str = "") -> str:
    """``"unknown WHAT"`` followed by the closest known name, and by the list of known names when
    there is no close one or the list is short: ``unknown field; did you mean training.train_steps?``,
    ``unknown section; did you mean optimizer? (known: data, ..., training)``."""
    known = sorted({str(k) for k in known})
    suggestion = did_you_mean(name, known, prefix)
    listed = f" (known: {', '.join(known)})" if not suggestion or len(known) <= SHORT_LIST else ""
    return f"unknown {what}{suggestion}{listed}"
