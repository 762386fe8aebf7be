"""Patch scopes: every change fe_megatron makes to another library's globals lasts as long as a run.

The Megatron adapter answers a few of megatron-core's assumptions by replacing attributes of its
modules (the CPU backend's ``torch``, Megatron-LM trainer's hooks), of ``torch.Tensor`` (two legacy
CUDA checks, on a host without a GPU) and by registering Megatron's gradient accumulation with the
core's kernels.  None of that happens at import: a run installs it into a `PatchScope` when it
starts and the scope puts everything back, in reverse order, when the run ends, also when it ends
with an exception:

* fe-pretrain's Megatron engine: `fe_megatron.megatron.parallel.initialize` opens the scope and
  `fe_megatron.megatron.parallel.shutdown` (the engine's ``shut_down``) closes it;
* Megatron-LM's trainer: `fe_megatron.megatron_lm.run.run` holds one for the whole run;
* a test or script of one's own: ``with PatchScope(): ...``, or `parallel.initialize`/`shutdown`.

Scopes nest.  A patch is either a named group installed once (`PatchScope.install`: the CPU
backend; an inner scope asking for a group an outer one installed does nothing and undoes nothing)
or a single replacement (`PatchScope.replace`), which the scope undoes however many times it
replaced the attribute.  Outside every scope, `active` is the process's own scope, which is never
closed: what a script installs there (``enable_cpu_backend()`` called bare) lasts until it exits.
"""

from __future__ import annotations

from typing import Callable

_MISSING = object()
_OPEN: list = []  # the scopes open now, outermost first


class PatchScope:
    """Replacements of other libraries' attributes and undo callbacks, undone in reverse order when
    the scope closes (the end of its ``with`` block, or `close`)."""

    def __init__(self, name: str = "run"):
        self.name = name
        self._undo: list = []  # callables, in the order their patches went in
        self._replaced: set = set()  # (id(owner), name) this scope replaced
        self._installed: set = set()  # the keys of the groups this scope installed
        self._open = False

    # ----------------------------------------------------------------- opening and closing
    def open(self) -> "PatchScope":
        if self._open:
            raise RuntimeError(f"patch scope {self.name!r} is already open: close it before opening it again")
        self._open = True
        _OPEN.append(self)
        return self

    def close(self) -> None:
        """Undo every patch, the last one first; closing a closed scope does nothing."""
        if not self._open:
            return
        self._open = False
        if self in _OPEN:
            _OPEN.remove(self)
        undo, self._undo = self._undo, []
        self._replaced.clear()
        self._installed.clear()
        errors = []
        for step in reversed(undo):
            try:
                step()
            except Exception as error:  # undo the rest anyway, then report
                errors.append(error)
        if errors:
            raise RuntimeError(f"patch scope {self.name!r} could not undo {len(errors)} patch(es): {errors}")

    def __enter__(self) -> "PatchScope":
        return self.open()

    def __exit__(self, *_exc) -> bool:
        self.close()
        return False

    @property
    def is_open(self) -> bool:
        return self._open

    # ----------------------------------------------------------------- patching
    def install(self, key: str, install: Callable[["PatchScope"], None]) -> bool:
        """Run ``install(self)``, which patches through this scope, unless an open scope (this one or
        one around it) installed the group ``key`` already.  Returns whether it ran."""
        self._require_open(key)
        if any(key in scope._installed for scope in _OPEN):
            return False
        self._installed.add(key)
        try:
            install(self)
        except BaseException:
            self._installed.discard(key)  # what it did patch is still undone when the scope closes
            raise
        return True

    def replace(self, owner, name: str, value) -> None:
        """``owner.name = value`` until this scope closes.  Replacing the same attribute again (a wrapper
        around an earlier wrapper) is fine: the scope restores what was there before the first."""
        self._require_open(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}")
        if (id(owner), name) not in self._replaced:
            self._replaced.add((id(owner), name))
            self._undo.append(_restorer(owner, name))
        setattr(owner, name, value)

    def call_on_exit(self, undo: Callable[[], None]) -> None:
        """Call ``undo()`` when the scope closes (a registration's removal), in reverse order with the rest."""
        self._require_open(getattr(undo, "__name__", "a callback"))
        self._undo.append(undo)

    def _require_open(self, what: str) -> None:
        if not self._open:
            raise RuntimeError(f"patch scope {self.name!r} is not open, so {what} would never be undone: patch "
                               "inside `with PatchScope(): ...` (or after `open()`)")


def _restorer(owner, name: str) -> Callable[[], None]:
    """What puts ``owner.name`` back as it is now: its own value, or, where it only inherits one (most of
    ``torch.Tensor``'s methods live on its C base class), no attribute of its own."""
    try:
        original = vars(owner).get(name, _MISSING)
    except TypeError:  # no __dict__
        original = getattr(owner, name)

    def restore():
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)

    return restore


_PROCESS = PatchScope("process")


def active() -> PatchScope:
    """The innermost open scope; outside every scope, the process's own (never closed)."""
    if _OPEN:
        return _OPEN[-1]
    if not _PROCESS.is_open:
        _PROCESS.open()
    return _PROCESS


def open_scopes() -> list:
    """The scopes open now, outermost first (what a test checks is empty after a run)."""
    return list(_OPEN)
