"""Fault injection for tests: make the next N operations fail in a chosen way."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Literal

from hicache.errors import MisuseError

FaultKind = Literal["eio", "enospc", "short", "eof", "corrupt", "slow", "fail", "hang"]
KINDS: tuple[FaultKind, ...] = ("eio", "enospc", "short", "eof", "corrupt", "slow", "fail", "hang")
HANG_S = 3600.0  # how long a ``hang`` blocks when neither released nor given ``delay_s``


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    op: Literal["read", "write", "any"] = "any"
    delay_s: float = 0.0
    # a ``hang`` taken by :meth:`FaultInjector.take`: the releases before it (a release
    # between taking and hanging lets it through)
    released_before: int | None = field(default=None, compare=False, repr=False)


class FaultInjector:
    """A thread-safe queue of faults consumed by the next matching operations.

    The ``file`` store understands every storage kind: ``eio``/``enospc`` raise that
    OSError, ``short`` makes the syscall move half the bytes (the caller must loop), ``eof``
    makes it move none (a read past the end), ``corrupt`` flips one byte of the page data,
    ``slow`` sleeps ``delay_s`` first, ``hang`` blocks the operation until :meth:`release`
    (or for ``delay_s``, else an hour) and then lets it proceed. The ``dir`` store reads and
    writes whole files, so it takes ``eio``, ``enospc``, ``corrupt``, ``slow`` and ``hang``
    only (``dir.DIR_FAULTS``); a fault of another kind stays queued for an operation that
    takes it. Device transfers understand ``fail`` (the copy ran but the ticket reports
    failure) and ``slow``.
    """

    def __init__(self) -> None:
        self._queue: deque[Fault] = deque()
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._releases = 0
        self.injected: dict[str, int] = {}
        self.hanging = 0  # operations blocked in a ``hang`` right now

    def add(
        self, kind: FaultKind, count: int = 1, *, op: Literal["read", "write", "any"] = "any", delay_s: float = 0.0
    ) -> None:
        if kind not in KINDS:
            raise MisuseError(f"unknown fault kind {kind!r}; choose from {KINDS}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise MisuseError(f"count must be an int >= 1, got {count!r}")
        if op not in ("read", "write", "any"):
            raise MisuseError(f"op must be 'read', 'write' or 'any', got {op!r}")
        if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not 0 <= delay_s < float("inf"):
            raise MisuseError(f"delay_s must be a finite number of seconds >= 0, got {delay_s!r}")
        with self._lock:
            self._queue.extend(Fault(kind, op, delay_s) for _ in range(count))

    def take(self, op: Literal["read", "write"], kinds: tuple[FaultKind, ...] = KINDS) -> Fault | None:
        """The next fault of one of ``kinds`` for an operation of type ``op``, if one is
        queued (a device transfer takes only the kinds it understands)."""
        with self._lock:
            for i, fault in enumerate(self._queue):
                if fault.op in (op, "any") and fault.kind in kinds:
                    del self._queue[i]
                    self.injected[fault.kind] = self.injected.get(fault.kind, 0) + 1
                    return replace(fault, released_before=self._releases) if fault.kind == "hang" else fault
        return None

    def hang(self, fault: Fault) -> None:
        """Block the calling (I/O) thread as ``fault`` says: until :meth:`release`, or
        ``delay_s`` (an hour if 0)."""
        with self._lock:
            if fault.released_before is not None and fault.released_before != self._releases:
                return  # NOTE: released between its take and now: it goes on at once
            released = self._released
            self.hanging += 1
        try:
            released.wait(fault.delay_s or HANG_S)
        finally:
            with self._lock:
                self.hanging -= 1

    def release(self) -> None:
        """Let every operation blocked in a ``hang``, or that has taken one, go on; hangs
        taken later block again."""
        with self._lock:
            self._released.set()
            self._released = threading.Event()
            self._releases += 1

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()

    @property
    def pending(self) -> int:
        return len(self._queue)
