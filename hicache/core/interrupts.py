"""Ctrl-C held back across the controller's bookkeeping.

Python runs a signal's handler between two bytecodes of the main thread, so a Ctrl-C can
raise ``KeyboardInterrupt`` in the middle of a call that moves pages between the tree, a
request and a transfer: half-done, the pages of the step not yet taken stay held forever,
or belong to two owners. Inside an :func:`atomic` call a SIGINT is only noted; when the
call returns, the handler that was in place gets it, so it runs exactly as it would have,
one call later: Python's own raises ``KeyboardInterrupt`` out of a call that has done all
it does.

How: while a cache built in the main thread is open, :func:`hold_sigint` puts a
:class:`_Forwarder` in SIGINT's place that passes every signal to the handler it replaced,
at once outside an atomic call and at its end inside one (swapping handlers on every call
would cost more than the call). The last cache to close puts that handler back, if the
forwarder is still in place. A forwarder keeps its handler for good: code that saved it
(``old = signal.signal(...)``) and puts it back later still reaches the handler it stood
for. A handler installed from C (``getsignal`` is None) cannot be put back, and an ignored
SIGINT has nothing to hold (and must stay ignored in the processes started meanwhile):
both are left alone; so are threads other than the main one, which never run handlers.

Not held: waits that may take long (a blocking restore, ``drain``: they change nothing until
a copy has landed, and what runs then is atomic), and a mover issuing a copy
(:func:`interruptible`): an embedder's mover may block, and the controller fails a transfer
whose issue an interrupt cut short.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_MAIN = threading.main_thread()
_MAIN_ID = _MAIN.ident


class _Held:
    depth = 0  # atomic calls open (main thread)
    came = False  # a SIGINT came inside one, not yet delivered
    came_to: _Forwarder | None = None  # the forwarder it came through
    users = 0  # open caches that hold SIGINT


class _Forwarder:
    """SIGINT's handler while caches are open: ``before`` gets each signal (module docstring)."""

    def __init__(self, before: Any) -> None:
        self.before = before

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if _Held.depth:
            _Held.came, _Held.came_to = True, self
            return
        self.deliver(signum, frame)

    def deliver(self, signum: int, frame: FrameType | None) -> None:
        before = self.before
        if callable(before):
            before(signum, frame)  # NOTE: Python's own raises KeyboardInterrupt here
        elif before == signal.SIG_DFL:  # the default action: the process ends, as it would have
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


def hold_sigint() -> bool:
    """Start holding SIGINT in atomic calls (one call per open cache); False where it cannot
    or need not be (another thread, a handler set from C, SIGINT ignored)."""
    if threading.current_thread() is not _MAIN:
        return False
    current = signal.getsignal(signal.SIGINT)
    if current is None or current == signal.SIG_IGN:
        return False
    if not isinstance(current, _Forwarder):
        signal.signal(signal.SIGINT, _Forwarder(current))
    _Held.users += 1
    return True


def release_sigint() -> None:
    """One cache that held SIGINT closed: the last one puts the handler back (unless someone
    replaced the forwarder since)."""
    _Held.users = max(0, _Held.users - 1)
    if _Held.users or threading.current_thread() is not _MAIN:
        return
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, _Forwarder):
        signal.signal(signal.SIGINT, current.before)


def _deliver_held() -> None:
    if _Held.came:
        to, _Held.came, _Held.came_to = _Held.came_to, False, None
        if to is not None:
            to.deliver(signal.SIGINT, None)


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
            _deliver_held()

    return held


@contextmanager
def interruptible() -> Iterator[None]:
    """Inside an atomic call, a stretch SIGINT is not held in (a mover issuing a copy): one
    that came before is delivered first."""
    if not _Held.depth or threading.get_ident() != _MAIN_ID:
        yield
        return
    _Held.depth = 0
    try:
        _deliver_held()
        yield
    finally:
        _Held.depth = 1
