"""What the interpreter's exit waits for, each within its bound.

A thread still inside a store's native code when the interpreter ends can crash the process
(a segmentation fault in Mooncake's client, "terminate called without an active exception"
from a daemon thread in torch's or the store's C++ code): the thread closing a store a cache
was collected without, or a remote store's call that outlived its deadline and ``close()``
left running. Each is registered here with a test of being done and a bound; at exit the
process waits until each is done or its bound, counted from the exit's start, has passed
(so all of them together for at most the longest bound), saying so on the log when it has
to wait.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# The most the exit waits for a remote store's calls that outlived close() (a Mooncake put
# against a master that died returned within 20 s where it was measured).
EXIT_WAIT_S = 30.0
_POLL_S = 0.02
_clock, _sleep = time.monotonic, time.sleep  # (a test's fake clock replaces these)
_lock = threading.Lock()
_waits: list[tuple[Callable[[], bool], float, str]] = []  # (done?, the most to wait in s, what)


_waiting = False  # _wait_all is running: what is registered meanwhile joins its loop


def wait_at_exit(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """At the interpreter's exit, wait until ``done()`` (at most ``timeout_s``) for ``what``.
    Called once the exit has started (a cache closed by an exit handler), it waits now:
    Python calls no exit handler registered while they run."""
    with _lock:
        _waits[:] = [w for w in _waits if not _done(w[0])]
        _waits.append((done, timeout_s, what))
        if _waiting:
            return
        exiting = not threading.main_thread().is_alive()  # NOTE: the exit stops it before its handlers
        if not exiting:
            # NOTE: registered again at every call so it runs first (atexit runs the last
            # registered first): before the exit handlers of the libraries the waited-for
            # work is still inside, those registered since the last call included. Not
            # once the exit has started: unregistered then, it would not run at all.
            atexit.unregister(_wait_all)
            atexit.register(_wait_all)
    if exiting:
        _wait_all()


def pending() -> list[str]:
    """What the exit would wait for now (for tests and status)."""
    with _lock:
        return [what for done, _, what in _waits if not _done(done)]


def _done(done: Callable[[], bool]) -> bool:
    try:
        return bool(done())
    except Exception:  # NOTE: one that cannot tell is not worth waiting for
        return True


def _wait_all() -> None:
    """Wait for each until it is done or its bound, counted from the exit's start, has
    passed: all together for at most the longest bound, those registered meanwhile (a store's
    close that itself waits on a thread) included."""
    global _waiting
    with _lock:
        if _waiting:
            return
        _waiting = True
    try:
        _wait_for_each()
    finally:
        with _lock:
            _waiting = False


def _wait_for_each() -> None:
    start = _clock()
    while True:
        with _lock:
            waits, _waits[:] = list(_waits), []
        waits = [w for w in waits if not _done(w[0])]
        if not waits:
            return
        for done, timeout_s, what in waits:
            end = start + timeout_s
            if _done(done) or _clock() >= end:
                continue
            log.warning("hicache: waiting up to %.0f s at exit for %s", end - _clock(), what)
            while not _done(done) and _clock() < end:
                _sleep(_POLL_S)
        if _clock() - start >= max(t for _, t, _ in waits):
            with _lock:
                _waits.clear()
            return
