"""Ctrl-C held back across the controller's bookkeeping.

Python runs a signal's handler between two bytecodes of the main thread, so a Ctrl-C can
raise ``KeyboardInterrupt`` in the middle of a call that moves pages between the tree, a
request and a transfer: half-done, the pages of the step not yet taken stay held forever,
or belong to two owners. Inside an :func:`atomic` call a SIGINT is only noted; when the
call returns, the handler that was in place gets it, so it runs exactly as it would have,
one call later: Python's own raises ``KeyboardInterrupt`` out of a call that has done all
it does.

How: while a cache built in the main thread is open, :func:`hold_sigint` puts a forwarder in
SIGINT's place that passes every signal to the handler it replaced, at once outside an
atomic call and at its end inside one (swapping handlers on every call would cost more
than the call). The last cache to close puts the handler back, if nobody replaced the
forwarder in the meantime. A handler installed from C (``getsignal`` is None) cannot be put
back, so it is left alone; so are threads other than the main one, which never run signal
handlers. Waits that may take long (a blocking restore, ``drain``) are not atomic: they
change nothing until a copy has landed, and what runs then is.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_MAIN = threading.main_thread()
_MAIN_ID = _MAIN.ident


class _Held:
    depth = 0  # atomic calls open (main thread)
    came = False  # a SIGINT came inside one
    users = 0  # open caches that hold SIGINT
    before: Any = None  # the handler the forwarder stands in for


def _forward(signum: int, frame: FrameType | None) -> None:
    if _Held.depth:
        _Held.came = True
        return
    _deliver(signum, frame)


def _deliver(signum: int, frame: FrameType | None) -> None:
    before = _Held.before
    if callable(before):
        before(signum, frame)  # NOTE: Python's own raises KeyboardInterrupt here
    elif before == signal.SIG_DFL:  # the default action: the process ends, as it would have
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
    # SIG_IGN: ignored, as it would have been


def hold_sigint() -> bool:
    """Start holding SIGINT in atomic calls (one call per open cache); False where it cannot
    be (another thread, a handler set from C)."""
    if threading.current_thread() is not _MAIN:
        return False
    current = signal.getsignal(signal.SIGINT)
    if current is None:
        return False
    if current is not _forward:
        _Held.before = current
        signal.signal(signal.SIGINT, _forward)
    _Held.users += 1
    return True


def release_sigint() -> None:
    """One cache that held SIGINT closed: the last one puts the handler back (unless someone
    replaced the forwarder since)."""
    _Held.users = max(0, _Held.users - 1)
    if _Held.users or threading.current_thread() is not _MAIN:
        return
    if signal.getsignal(signal.SIGINT) is _forward:
        signal.signal(signal.SIGINT, _Held.before)
    _Held.before = None


def atomic(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` runs with SIGINT held (module docstring)."""

    @functools.wraps(fn)
    def held(*args: P.args, **kwargs: P.kwargs) -> R:
        if _Held.depth or not _Held.users or threading.get_ident() != _MAIN_ID:
            return fn(*args, **kwargs)
        _Held.depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            _Held.depth = 0
            if _Held.came:
                _Held.came = False
                _deliver(signal.SIGINT, None)

    return held
