"""Ctrl-C, and the other signals a Python handler may raise from, held back across the
controller's bookkeeping.

Python runs a signal's handler between two bytecodes of the main thread, so a Ctrl-C (or a
timeout raised from a SIGALRM handler, a SIGTERM handler's ``SystemExit``) can raise in the
middle of a call that moves pages between the tree, a request and a transfer: half-done,
the pages of the step not yet taken stay held forever, or belong to two owners. Inside an
:func:`atomic` call such a signal is only noted; when the call returns, the handler that was
in place gets it, so it runs exactly as it would have, one call later: Python's own raises
``KeyboardInterrupt`` out of a call that has done all it does.

Held: SIGINT, and SIGTERM, SIGHUP, SIGALRM, SIGVTALRM, SIGPROF, SIGUSR1 and SIGUSR2 where a
Python handler is set for them when a cache opens (at their default action they end the
process, which raises nothing; a handler set while caches are open is not held).

How: while a cache built in the main thread is open, :func:`hold_signals` puts a
:class:`_Forwarder` in each held signal's place that passes every signal to the handler it
replaced, at once outside an atomic call and at its end inside one (swapping handlers on every
call would cost more than the call). The last cache to close puts those handlers back, where
the forwarder is still in place. A forwarder keeps its handler for good: code that saved it
(``old = signal.signal(...)``) and puts it back later still reaches the handler it stood
for. A handler installed from C (``getsignal`` is None) cannot be put back, and an ignored
signal has nothing to hold (and must stay ignored in the processes started meanwhile):
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
from typing import Any, ClassVar, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_MAIN = threading.main_thread()
_MAIN_ID = _MAIN.ident


# NOTE: SIGINT first: at its default action Python's own handler raises KeyboardInterrupt;
# the others only where a Python handler is set (by name: not every platform has them all)
_HELD = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)


class _Held:
    depth = 0  # atomic calls open (main thread)
    came: ClassVar[dict[int, _Forwarder]] = {}  # signals that came inside one, not yet delivered (in order)
    users = 0  # open caches that hold signals
    raised: BaseException | None = None  # what a held signal's handler raised last (from_signal)


class _Forwarder:
    """A held signal's handler while caches are open: ``before`` gets each signal (module
    docstring)."""

    def __init__(self, before: Any) -> None:
        self.before = before

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if _Held.depth:
            _Held.came.setdefault(signum, self)  # NOTE: as the OS does, one pending per signal
            return
        if _Held.came:
            # NOTE: signals held by an atomic call whose end has not delivered them yet (this
            # one came in between): theirs first, in order, and a handler that raises does
            # not keep the others back (:func:`_deliver_held`)
            _Held.came.setdefault(signum, self)
            _deliver_held()
            return
        self.deliver(signum, frame)

    def deliver(self, signum: int, frame: FrameType | None) -> None:
        before = self.before
        if callable(before):
            try:
                before(signum, frame)  # NOTE: Python's own raises KeyboardInterrupt here
            except BaseException as exc:
                _Held.raised = exc
                raise
        elif before == signal.SIG_DFL:  # the default action: the process ends, as it would have
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


def _holdable(signum: int, current: Any) -> bool:
    if current is None or current == signal.SIG_IGN:
        return False
    return signum == signal.SIGINT or callable(current)


def hold_signals() -> bool:
    """Start holding signals in atomic calls (one call per open cache); False where it cannot
    be (another thread)."""
    if threading.current_thread() is not _MAIN:
        return False
    for signum in _HELD:
        current = signal.getsignal(signum)
        if _holdable(signum, current) and not isinstance(current, _Forwarder):
            signal.signal(signum, _Forwarder(current))
    _Held.users += 1
    return True


def release_signals() -> None:
    """One cache that held signals closed: the last one puts the handlers back (unless someone
    replaced a forwarder since)."""
    _Held.users = max(0, _Held.users - 1)
    if _Held.users or threading.current_thread() is not _MAIN:
        return
    for signum in _HELD:
        current = signal.getsignal(signum)
        if isinstance(current, _Forwarder):
            signal.signal(signum, current.before)
    _raise_again()  # NOTE: none should be left; if one is, its own handler gets it now


def _raise_again() -> None:
    """Signals still held go back to the OS: each handler in place gets its own, at once.

    Raised while blocked and then unblocked together, so all are pending before any handler
    runs: one that raises does not keep the others from being raised (Python runs the rest
    at its next check)."""
    left = list(_Held.came)
    _Held.came.clear()
    if not left:
        return
    masked = hasattr(signal, "pthread_sigmask")
    if masked:
        signal.pthread_sigmask(signal.SIG_BLOCK, left)
    try:
        for signum in left:
            signal.raise_signal(signum)
    finally:
        if masked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, left)


def _deliver_held() -> None:
    try:
        while _Held.came:
            signum = next(iter(_Held.came))
            to = _Held.came.pop(signum)
            to.deliver(signum, None)
    except BaseException:
        # NOTE: one handler raised (Ctrl-C's): the others' signals are raised again, so their
        # handlers run now, beside that exception, not at some later call's end, or never
        _raise_again()
        raise


def from_signal(exc: BaseException) -> bool:
    """Whether ``exc`` is what a held signal's handler raised (a timeout's, say, while a mover
    issued a copy): the caller's to hear, not a failure of the code it interrupted."""
    if exc is not _Held.raised:
        return False
    _Held.raised = None
    return True


def by_signal(exc: BaseException) -> bool:
    """Whether ``exc`` is what a held signal's handler raised, leaving it for the caller's
    :func:`from_signal`: code below the controller that takes a failure for a bad answer
    (a store's ``available`` that raises) passes such an exception on instead."""
    return exc is _Held.raised


def atomic(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` runs with signals held (module docstring)."""

    @functools.wraps(fn)
    def held(*args: P.args, **kwargs: P.kwargs) -> R:
        if _Held.depth or not _Held.users or threading.get_ident() != _MAIN_ID:
            return fn(*args, **kwargs)
        _Held.depth, _Held.raised = 1, None
        try:
            return fn(*args, **kwargs)
        finally:
            _Held.depth = 0
            _deliver_held()

    return held


@contextmanager
def held() -> Iterator[None]:
    """A block that runs as an :func:`atomic` call does (a stretch of set-up that must not be
    left half-done: threads started, a resource and the finalizer that frees it)."""
    if _Held.depth or not _Held.users or threading.get_ident() != _MAIN_ID:
        yield
        return
    _Held.depth, _Held.raised = 1, None
    try:
        yield
    finally:
        _Held.depth = 0
        _deliver_held()


@contextmanager
def interruptible() -> Iterator[None]:
    """Inside an atomic call, a stretch signals are not held in (a mover issuing a copy):
    those that came before are delivered first."""
    if not _Held.depth or threading.get_ident() != _MAIN_ID:
        yield
        return
    _Held.depth = 0
    try:
        _deliver_held()
        yield
    finally:
        _Held.depth = 1
