"""Transfer tickets: the handle a backend returns for one asynchronous copy."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hicache.spec.model import Direction

Check = Callable[[bool], "bool | None"]


@dataclass(slots=True)
class Timings:
    """Where a transfer's time went. ``setup_s`` is one-time (workspace allocation) and is
    excluded from :attr:`recurring_s`, which is what the cost model learns from."""

    enqueue_s: float = 0.0  # CPU time to issue the copy (index upload, host gather, launches)
    setup_s: float = 0.0  # one-time workspace allocation inside enqueue
    queue_s: float = 0.0  # waiting before service began (I/O pool; not observable on a stream)
    service_s: float = 0.0  # kernel + DMA (device events) or file I/O
    complete_s: float = 0.0  # CPU work at completion (host index_copy_, checksum checks)
    total_s: float = 0.0  # from the call until the caller observed completion (poll lag included)

    @property
    def recurring_s(self) -> float:
        """The work's own recurring time: enqueue (less setup), queue, service, completion.
        Excludes one-time setup and the lag until someone polled the ticket."""
        return max(0.0, self.enqueue_s - self.setup_s) + self.queue_s + self.service_s + self.complete_s


@dataclass(eq=False)
class Ticket:
    """One transfer in flight. ``poll()`` advances it without blocking; ``wait()`` blocks.

    ``ok`` is None while pending, then True or False (``error`` says why). A failed ticket
    never published anything: its destination pages hold garbage and stay private.
    The backend that made it attaches its completion check with :meth:`bind` (or finishes
    it at once with :meth:`finish_now`); callbacks added with :meth:`add_done_callback` run
    once, when it finishes.
    """

    direction: Direction
    pages: int
    nbytes: int
    started: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=Timings)
    ok: bool | None = None
    error: str | None = None
    extents: int = 0
    finished_at: float | None = None  # perf_counter when the work itself ended, if known
    _check: Check | None = None  # (block) -> None while pending
    _withdraw: Callable[[], bool] | None = None  # withdraws work not yet started; True if it did
    _done: list[Callable[[Ticket], None]] = field(default_factory=list, repr=False)

    def bind(self, check: Check, withdraw: Callable[[], bool] | None = None) -> None:
        """Attach the completion check: ``check(block)`` returns None while the work is
        pending (only when ``block`` is False), else whether it succeeded; it runs the
        backend's completion work and is called once with a result. ``withdraw()`` (if the
        backend can) takes back work not yet started and says whether it did."""
        self._check = check
        self._withdraw = withdraw

    def cancel(self) -> bool:
        """Withdraw the copy if none of it has started: True means nothing was or will be
        written (the ticket then reports ``ok`` False); False means it runs to its end."""
        if self.ok is not None or self._withdraw is None or not self._withdraw():
            return False
        self.finish_now(False, "cancelled")
        return True

    def poll(self) -> bool:
        """True once finished (successfully or not). Runs completion work exactly once."""
        if self.ok is not None:
            return True
        if self._check is None:
            raise RuntimeError("ticket has no completion check")
        result = self._check(False)
        if result is None:
            return False
        self._finish(result)
        return True

    def wait(self) -> bool:
        """Block until finished; returns ``ok``."""
        if self.ok is None:
            if self._check is None:
                raise RuntimeError("ticket has no completion check")
            result = self._check(True)
            if result is None:
                raise RuntimeError("a blocking completion check returned no result")
            self._finish(result)
        return bool(self.ok)

    def finish_now(self, ok: bool, error: str | None = None) -> None:
        """Finish at once (nothing was issued, or the backend ran it synchronously)."""
        if error is not None:
            self.error = error
        self._finish(ok)

    def fail_now(self, error: str) -> None:
        """Mark failed (used at enqueue time, before anything was issued)."""
        self.finish_now(False, error)

    def add_done_callback(self, fn: Callable[[Ticket], None]) -> None:
        """Call ``fn(self)`` once the ticket finishes (at once if it already has)."""
        if self.ok is not None:
            fn(self)
        else:
            self._done.append(fn)

    def _finish(self, ok: bool) -> None:
        self.ok = ok
        t = self.timings
        t.total_s = time.perf_counter() - self.started
        if self.finished_at is not None:
            t.queue_s = max(0.0, self.finished_at - self.started - t.enqueue_s - t.service_s)
        self._check = self._withdraw = None
        done, self._done = self._done, []
        for fn in done:
            fn(self)

    @property
    def gib_per_s(self) -> float:
        t = self.timings.recurring_s
        return self.nbytes / t / 2**30 if t > 0 else 0.0
