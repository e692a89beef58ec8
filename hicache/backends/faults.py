"""Fault injection for tests: make the next N operations fail in a chosen way."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal

FaultKind = Literal["eio", "enospc", "short", "eof", "corrupt", "slow", "fail"]
KINDS: tuple[FaultKind, ...] = ("eio", "enospc", "short", "eof", "corrupt", "slow", "fail")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    op: Literal["read", "write", "any"] = "any"
    delay_s: float = 0.0


class FaultInjector:
    """A thread-safe queue of faults consumed by the next matching operations.

    Storage operations understand every kind: ``eio``/``enospc`` raise that OSError,
    ``short`` makes the syscall move half the bytes (the caller must loop), ``eof`` makes it
    move none (a read past the end), ``corrupt`` flips one byte of the page data, ``slow``
    sleeps ``delay_s`` first. Device transfers understand ``fail`` (the copy ran but the
    ticket reports failure) and ``slow``.
    """

    def __init__(self) -> None:
        self._queue: deque[Fault] = deque()
        self._lock = threading.Lock()
        self.injected: dict[str, int] = {}

    def add(
        self, kind: FaultKind, count: int = 1, *, op: Literal["read", "write", "any"] = "any", delay_s: float = 0.0
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; choose from {KINDS}")
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
                    return fault
        return None

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()

    @property
    def pending(self) -> int:
        return len(self._queue)
