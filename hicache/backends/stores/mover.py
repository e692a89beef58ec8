"""``StoreMover``: the asynchronous L2 <-> L3 face of any :class:`PageStore`.

The scheduler thread only validates a request and queues it (``write`` / ``read``, O(1) past
the page checks) and reads one flag when it polls; everything else runs on the I/O threads:

    caller: check pages -> queue (job)            I/O threads: plan -> chunks -> store.put/get
    caller: ticket.poll() -> job.outcome?                       last chunk -> outcome, timings

Reads are served before queued writes (a restore waits on them; a backup does not).

Deadlines: a request not finished ``deadline_s + deadline_s_per_gib * GiB`` after it was
queued fails (the request recomputes). Its chunks that have not started never start; the
ones still running keep their pages (``ticket.held_host_pages`` / ``held_slots``) until
they return, and :meth:`StoreMover.reap` then lists the ticket once, ``settled``. The I/O
threads are daemons and ``close`` waits at most ``close_timeout_s``: a hung disk cannot
wedge shutdown; the store itself closes when its last straggler returns.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.backends.faults import FaultInjector
from hicache.backends.pools import HostPool, PageFences, check_pages
from hicache.backends.stores import at_exit
from hicache.backends.stores.base import LOST, STORED, Op, PageStatus, PageStore, StoreTicket
from hicache.backends.transfer import DeviceTicket
from hicache.core.interrupts import by_signal, held
from hicache.core.keys import KEY_BYTES
from hicache.errors import ConfigError, MisuseError, PageOwnershipError
from hicache.spec.model import Direction

log = logging.getLogger(__name__)
# While the store keeps failing, its warning repeats at most this often (with the count).
FAILING_WARN_S = 30.0
_READ, _WRITE, _STOP = 0, 1, 2  # queue priorities


class _Job:
    """One request: its pages, chunks and outcome. Mutated under the mover's lock."""

    __slots__ = (
        "above",
        "chunks",
        "deadline",
        "deps",
        "errors",
        "event",
        "expired",
        "extents",
        "first_start",
        "hp",
        "keys",
        "last_end",
        "op",
        "outcome",
        "pending",
        "running",
        "sl",
        "statuses",
        "ticket",
    )

    def __init__(
        self, op: Op, ticket: StoreTicket, hp: list[int], sl: list[int], keys: list[bytes] | None, deadline: float
    ) -> None:
        self.op = op
        self.ticket = ticket
        self.hp = hp
        self.sl = sl
        self.keys = keys
        self.above: list[bytes] = []  # the prompt's keys before ``keys``: ranked as used after them
        self.deadline = deadline
        self.deps: list[DeviceTicket] = []  # device transfers to settle before touching pages
        self.chunks: list[tuple[int, int]] = []
        self.pending = -1  # chunks not yet finished or skipped; -1 until planned
        self.running: dict[int, tuple[int, int]] = {}
        self.statuses = [PageStatus.SKIPPED] * len(sl)
        self.errors: list[str] = []
        self.event = threading.Event()
        self.outcome: bool | None = None
        self.expired = False
        self.extents = 0
        self.first_start = math.inf
        self.last_end = 0.0


def _held(count: object, asked: int) -> int:
    """A store's ``exists`` answer: how many of the ``asked`` leading keys it holds (an int,
    numpy's too, in ``[0, asked]``); anything else is that call's failure (ValueError)."""
    if isinstance(count, np.integer):
        count = int(count)
    if type(count) is not int or not 0 <= count <= asked:
        raise ValueError(f"exists() must return how many of the {asked} leading keys it holds, got {count!r:.60}")
    return count


class StoreMover:
    """H2S (L2 -> L3) and S2H (L3 -> L2) over ``store``, on ``workers`` I/O threads."""

    def __init__(
        self,
        store: PageStore,
        host: HostPool,
        *,
        slots: int,
        workers: int = 4,
        deadline_s: float | None = 10.0,
        deadline_s_per_gib: float = 10.0,
        close_timeout_s: float = 5.0,
        exists_pages: int = 2048,
        exists_timeout_s: float = 0.25,
        faults: FaultInjector | None = None,
    ) -> None:
        check_mover_config(
            slots, workers, deadline_s, deadline_s_per_gib, close_timeout_s, exists_pages, exists_timeout_s
        )
        self.store = store
        self.host = host
        self.slots = slots
        self.bytes_per_page = host.geometry.bytes_per_page
        self.deadline_s = deadline_s
        self.deadline_s_per_gib = deadline_s_per_gib
        self.close_timeout_s = close_timeout_s
        self.exists_pages = exists_pages
        self.exists_timeout_s = exists_timeout_s
        self.faults = faults or FaultInjector()
        self.closed = False
        self._lock = threading.Lock()
        self._queue: queue.PriorityQueue[tuple[int, int, _Job | None, int]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._active: set[_Job] = set()
        self._slot_fences = PageFences("L3")
        self._settled: list[StoreTicket] = []
        self._running = 0  # chunks inside store.put/get right now
        self._closing = False
        self._store_gone = threading.Event()  # the store's close() has returned
        self._store_closed = False
        self._exists_busy = False
        self._failing = 0  # jobs failed in a row (pages not stored or read, not merely lost)
        self._warned_at = -math.inf
        self._warned_streak = False  # this streak was logged (so its end is too)
        self._control: queue.SimpleQueue[tuple[list[bytes], list[int], threading.Event]] | None = None
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "reads",
                "writes",
                "failed",
                "expired",
                "lost_pages",
                "pages_already_stored",
                "extents",
                "exists_calls",
                "exists_failed",
                "exists_timeouts",
                "unavailable",
                "available_raised",
            ),
            0,
        )
        self._threads = [
            threading.Thread(target=self._worker, name=f"hicache-l3-{i}", daemon=True) for i in range(workers)
        ]
        try:
            with held():  # NOTE: a signal's exception mid-start: CPython's KeyError, a thread not started
                for t in self._threads:
                    t.start()
        except BaseException:  # NOTE: the signal's, once all started: no one else will stop them
            for _ in self._threads:
                self._queue.put((_STOP, next(self._seq), None, 0))
            raise

    # -- the StorageMover face ----------------------------------------------------------------

    @property
    def keyed(self) -> bool:
        """Pages are addressed by content key (keys must be given)."""
        return self.store.keyed

    @property
    def shared(self) -> bool:
        """Pages can appear or vanish behind our back (restarts, other processes)."""
        return self.store.shared

    @property
    def persistent(self) -> bool:
        """What is written outlives this process (a shared store): worth finishing at close."""
        return self.store.shared

    @property
    def available(self) -> bool:
        return not self.closed and self._store_available()

    def _store_status(self) -> dict[str, Any]:
        """The store's ``status()``; one that raises or is not a dict says so in ``error``."""
        try:
            status = self.store.status()
        except Exception as exc:
            if by_signal(exc):
                raise  # NOTE: a timeout's, while a copy was issued: the caller's, not the store's
            return {"error": f"status() raised {exc!r}"}
        return dict(status) if isinstance(status, dict) else {"error": f"status() returned {status!r:.60}"}

    def _store_available(self) -> bool:
        """The store's ``available``; one that raises (a custom store's bug) counts as not."""
        try:
            return bool(self.store.available)
        except Exception as exc:
            if by_signal(exc):
                raise  # NOTE: a timeout's, while a copy was issued: the caller's, not the store's
            if not self.counts["available_raised"]:  # NOTE: once: it is read at every admission
                log.warning("hicache L3 store's available raised: %r (taken as unavailable)", exc)
            self.counts["available_raised"] += 1
            return False

    def write(
        self,
        host_pages: Sequence[int],
        slots: Sequence[int],
        keys: Sequence[bytes] | None = None,
        *,
        above: Sequence[bytes] = (),
    ) -> StoreTicket:
        """H2S: store L2 pages (asynchronous). Pages the store already has are not written
        again (their status is EXISTS, and the ticket succeeds). ``above``: the keys of the
        prompt's pages before these; a store that keeps recency (dir) ranks them, then
        these, as the most recently used once the job ends, so eviction takes the prompt
        from its end even when its pages arrived in several jobs (a read ranks them in
        memory only: its ticket does not wait for their mtimes)."""
        return self._submit("write", host_pages, slots, keys, above)

    def read(
        self,
        slots: Sequence[int],
        host_pages: Sequence[int],
        keys: Sequence[bytes] | None = None,
        *,
        above: Sequence[bytes] = (),
    ) -> StoreTicket:
        """S2H: load pages into L2 (asynchronous). A page the store no longer has fails the
        ticket with ``lost`` set. ``above`` as for :meth:`write`."""
        return self._submit("read", host_pages, slots, keys, above)

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the store holds: one batched call of at most
        ``exists_pages`` keys, waited for at most ``exists_timeout_s``; 0 on any error."""
        if not self.store.keyed or self.closed or not keys or not self._store_available():
            return 0
        batch = list(keys[: self.exists_pages])
        _check_keys(batch, len(batch))
        self.counts["exists_calls"] += 1
        if not self.store.remote:
            try:
                return _held(self.store.exists(batch), len(batch))
            except Exception as exc:
                return self._exists_failed(exc)
        return self._exists_remote(batch)

    def reap(self) -> list[StoreTicket]:
        """Tickets failed by their deadline whose I/O has since returned (each listed once):
        their ``held_*`` pages may be reused now."""
        with self._lock:
            out, self._settled = self._settled, []
        return out

    @property
    def shut(self) -> bool:
        """:meth:`close` got past its waits: the store is closed, or closes as its last I/O
        returns. (``closed`` is set at close's start: nothing new is taken from then.)"""
        return self._closing

    def close(self, *, wait: bool = True) -> None:
        """Finish queued work (``wait``, at most ``close_timeout_s``) or cancel it; requests
        still unfinished then fail. Returns in bounded time even if I/O hangs. Cut short
        while it waits (Ctrl-C), it stops waiting and still closes: I/O still running closes
        the store as it returns."""
        if self._closing:
            with self._lock:
                now = self._running == 0
            if now:  # NOTE: a close cut short between its waits' end and the store's close
                self._close_store()
            return
        self.closed = True
        end = time.perf_counter() + self.close_timeout_s
        try:
            if wait:
                with self._lock:
                    jobs = list(self._active)
                for job in jobs:
                    job.event.wait(max(0.0, end - time.perf_counter()))
        except BaseException:
            self._shut(end, join=False)
            raise
        self._shut(end, join=True)

    def _shut(self, end: float, *, join: bool) -> None:
        """The end of :meth:`close`: fail what is unfinished, stop the workers (``join``: wait
        for them until ``end``), close the store now or as its last I/O returns."""
        try:
            with held():  # NOTE: cut short, a worker would wait for work forever
                with self._lock:
                    jobs = list(self._active)
                for job in jobs:
                    self._expire(job, "L3 storage closed before the request finished")
                for _ in self._threads:
                    self._queue.put((_STOP, next(self._seq), None, 0))
            if join:
                for t in self._threads:
                    t.join(max(0.0, end - time.perf_counter()))
        finally:  # NOTE: a join cut short closes all the same
            with self._lock:
                self._closing = True
                now = self._running == 0
            if now:
                self._close_store()
            else:
                log.warning(
                    "hicache L3: %d I/O still running at close; the store closes when they return", self._running
                )
                if self.store.remote:
                    # NOTE: a remote store's native call returning while the interpreter ends
                    # crashes the process (Mooncake's client, after its master died): the exit
                    # waits for it
                    what = f"{self.store.kind} store calls still running past close()"
                    at_exit.wait_at_exit(self._store_gone.is_set, at_exit.EXIT_WAIT_S, what)

    def status(self) -> dict[str, Any]:
        with self._lock:
            running = self._running
            active = len(self._active)
            failing = self._failing
        return {
            "kind": self.store.kind,
            "slots": self.slots,
            "keyed": self.store.keyed,
            "shared": self.store.shared,
            "available": self.available,
            **self._store_status(),
            **self.counts,
            "in_flight": active,
            "io_running": running,
            "failing_in_a_row": failing,  # requests failed since the last that went through
            "deadline_s": self.deadline_s,
            "faults_injected": dict(self.faults.injected),
        }

    @property
    def extents(self) -> int:
        return self.counts["extents"]

    # -- submission (the caller's thread) ------------------------------------------------------

    def _submit(
        self,
        op: Op,
        host_pages: Sequence[int],
        slots: Sequence[int],
        keys: Sequence[bytes] | None,
        above: Sequence[bytes] = (),
    ) -> StoreTicket:
        t0 = time.perf_counter()
        if self.closed:
            raise ConfigError("storage backend is closed")
        direction = Direction.H2S if op == "write" else Direction.S2H
        host_pages = check_pages("L2", host_pages, self.host.num_pages)
        slots = check_pages("L3", slots, self.slots)
        n = len(slots)
        if len(host_pages) != n:
            raise PageOwnershipError(f"{direction.name}: {len(host_pages)} host pages for {n} slots")
        if keys is not None:
            _check_keys(keys, n)
            if above:
                _check_keys(above, len(above))
        elif self.store.keyed:
            raise MisuseError(f"{direction.name}: the {self.store.kind} store addresses pages by key; give keys")
        ticket = StoreTicket(direction, n, n * self.bytes_per_page, started=t0)
        if not n:
            ticket.finish_now(True)
            return ticket
        if not self._store_available():
            self.counts["unavailable"] += 1
            ticket.statuses = [PageStatus.FAILED] * n
            ticket.fail_now(f"L3 {self.store.kind} store unavailable: {self._store_status().get('error', '')}")
            return ticket
        deadline = math.inf
        if self.deadline_s is not None:
            deadline = t0 + self.deadline_s + self.deadline_s_per_gib * ticket.nbytes / 2**30
        ticket.deadline = deadline
        # NOTE: order after transfers still touching these pages (the pools' fences): wait
        # here for host-side ones; the I/O threads settle device ones before touching pages.
        to_l2 = op == "read"
        deps = self.host.pending(host_pages, write=to_l2) + self._slot_fences.pending(slots, write=not to_l2)
        for dep in deps:
            if not isinstance(dep, DeviceTicket):
                dep.wait()
        job = _Job(op, ticket, list(host_pages), list(slots), None if keys is None else list(keys), deadline)
        if keys is not None:
            job.above = list(above)
        job.deps = [d for d in deps if isinstance(d, DeviceTicket)]
        ticket.bind(lambda block: self._check(job, block), lambda: self._withdraw(job))
        try:
            with self._lock:
                self._active.add(job)
            self.host.fence(host_pages, ticket, write=to_l2)
            self._slot_fences.fence(slots, ticket, write=not to_l2)
            self._queue.put((_READ if op == "read" else _WRITE, next(self._seq), job, -1))
        except BaseException:
            # NOTE: an interrupt (a signal handler's exception: issuing is interruptible) once
            # the job was registered: no one gets this ticket, and fenced but never queued it
            # would hold the next copy of these pages until its deadline (with none: forever);
            # withdrawn, it never runs (queued chunks skip it) and is finished for its waiters
            self._withdraw(job)
            raise
        ticket.timings.enqueue_s = time.perf_counter() - t0
        return ticket

    def _check(self, job: _Job, block: bool) -> bool | None:
        if job.outcome is not None:
            return job.outcome
        if block:
            timeout = None if job.deadline == math.inf else max(0.0, job.deadline - time.perf_counter())
            if job.event.wait(timeout):  # set together with the outcome
                return bool(job.outcome)
        elif time.perf_counter() < job.deadline:
            return None
        what = f"L3 {job.op} of {len(job.sl)} pages"
        return self._expire(job, f"deadline: {what} not done after {job.deadline - job.ticket.started:.1f} s")

    def _withdraw(self, job: _Job) -> bool:
        """Take back ``job`` if none of its I/O has started (its chunks will never start)."""
        with self._lock:
            if job.outcome is not None or job.running or job.first_start != math.inf:
                return False
            job.expired = True  # NOTE: what makes queued chunks skip; the ticket is not "expired"
            job.ticket.statuses = [PageStatus.SKIPPED] * len(job.sl)
            self._active.discard(job)
            job.outcome = False
            job.event.set()
        return True

    def _expire(self, job: _Job, reason: str) -> bool:
        """Fail ``job`` now unless it already finished; its running chunks become stragglers."""
        with self._lock:
            if job.outcome is not None:
                return job.outcome
            t = job.ticket
            job.expired = True
            t.expired = True
            t.error = reason
            for a, b in job.running.values():
                t.held_host_pages.extend(job.hp[a:b])
                t.held_slots.extend(job.sl[a:b])
                job.statuses[a:b] = [PageStatus.FAILED] * (b - a)
            t.statuses = list(job.statuses)
            t.settled = not job.running
            self.counts["expired"] += 1
            self.counts["failed"] += 1
            self._active.discard(job)
            job.outcome = False
            job.event.set()
            self._note_health(reason)  # a hung store's requests expire: logged as its failures are
        return False

    # -- the I/O threads -------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            _, _, job, chunk = self._queue.get()
            if job is None:
                return
            try:
                if chunk < 0:
                    self._plan(job)
                else:
                    self._run(job, chunk)
            except Exception:  # a bug: the thread goes on (its death left L3 to its deadlines)
                log.exception("hicache L3: an I/O thread's %s job raised", job.op)

    def _plan(self, job: _Job) -> None:
        if job.expired:
            with self._lock:
                job.pending = 0
                self._chunk_ended(job)
            return
        try:
            chunks, extents = self.store.plan(job.op, job.hp, job.sl)
            _check_chunks(chunks, len(job.sl))
        except Exception as exc:
            chunks, extents = [(0, len(job.sl))], 0
            with self._lock:
                job.errors.append(f"{job.op} failed: {type(exc).__name__}: {exc}")
        with self._lock:
            job.chunks = chunks
            job.extents = extents
            job.pending = len(chunks)
        prio = _READ if job.op == "read" else _WRITE
        for i in range(1, len(chunks)):
            self._queue.put((prio, next(self._seq), job, i))
        self._run(job, 0)

    def _run(self, job: _Job, i: int) -> None:
        a, b = job.chunks[i]
        with self._lock:
            if job.expired or job.errors:  # past its deadline, closed, or unplannable: never start
                job.pending -= 1
                if job.errors:
                    job.statuses[a:b] = [PageStatus.FAILED] * (b - a)
                self._chunk_ended(job)
                return
            job.running[i] = (a, b)
            job.first_start = min(job.first_start, time.perf_counter())
            self._running += 1
        for dep in job.deps:
            dep.settle()
        t0 = time.perf_counter()
        keys = None if job.keys is None else job.keys[a:b]
        error = None
        try:
            if job.op == "write":
                statuses = self.store.put(job.hp[a:b], job.sl[a:b], keys)
            else:
                statuses = self.store.get(job.hp[a:b], job.sl[a:b], keys)
            if len(statuses) != b - a:
                raise RuntimeError(f"store returned {len(statuses)} statuses for {b - a} pages")
            statuses = [PageStatus(x) for x in statuses]  # a value that is none: a failed chunk
        except Exception as exc:  # an OSError or an unexpected error: never success
            statuses = [PageStatus.FAILED] * (b - a)
            error = f"{job.op} failed: {type(exc).__name__}: {exc}"
            log.warning("hicache L3 %s", error)
        t1 = time.perf_counter()
        stamp = getattr(self.store, "stamp", None)
        with self._lock:
            del job.running[i]
            job.pending -= 1
            job.first_start = min(job.first_start, t0)
            job.last_end = max(job.last_end, t1)
            if job.outcome is None:
                job.statuses[a:b] = statuses
                if error is not None:
                    job.errors.append(error)
            # NOTE: a store that keeps recency on disk (dir: mtimes, a syscall per page) gets the
            # whole job's order once its last chunk ended, outside the lock and before the ticket
            # ends; this chunk counts as running until then (the store stays open).
            stamp_now = stamp is not None and job.keys is not None and job.pending == 0 and job.outcome is None
            if not stamp_now:
                self._running -= 1
                close_store = self._chunk_ended(job)
        if stamp_now:
            assert stamp is not None
            try:
                # NOTE: a read's ticket ends after its stamp: the pages above it (not read) are
                # ranked in memory only, so a restore does not wait for a syscall per page of
                # its prompt's head.
                stamp(self._ordered(job, above=job.op == "write"))
            finally:
                with self._lock:
                    self._running -= 1
                    close_store = self._chunk_ended(job)
        if close_store:
            self._close_store()

    @staticmethod
    def _ordered(job: _Job, *, above: bool = True) -> list[bytes]:
        """The keys before ``job``'s in its prompt (with ``above``), then those of ``job``
        that ended read or stored, in order (a prompt's pages)."""
        assert job.keys is not None
        good = STORED if job.op == "write" else frozenset({PageStatus.OK})
        return [*(job.above if above else ()), *(k for k, s in zip(job.keys, job.statuses, strict=True) if s in good)]

    def _chunk_ended(self, job: _Job) -> bool:
        """Under the lock: finish the job if this was its last chunk, settle a straggling
        ticket, and say whether the store should close now."""
        if job.pending == 0 and job.outcome is None:
            self._finish(job)
        t = job.ticket
        if job.expired and not job.running and not t.settled:
            t.settled = True
            self._settled.append(t)
        return self._closing and self._running == 0 and not self._store_closed

    def _finish(self, job: _Job) -> None:
        t = job.ticket
        st = job.statuses
        good = STORED if job.op == "write" else frozenset({PageStatus.OK})
        bad = [i for i, s in enumerate(st) if s not in good]
        lost = [i for i in bad if st[i] in LOST]
        order = getattr(self.store, "order", None)
        if order is not None and job.keys is not None:
            order(self._ordered(job))  # before the ticket ends: in memory, cheap
        t.statuses = st
        t.lost = bool(lost)
        t.extents = job.extents
        if job.last_end:
            t.timings.service_s = job.last_end - job.first_start
            t.finished_at = job.last_end
        self.counts["reads" if job.op == "read" else "writes"] += 1
        if job.op == "write":
            self.counts["pages_already_stored"] += st.count(PageStatus.EXISTS)
        if bad:
            self.counts["failed"] += 1
            self.counts["lost_pages"] += len(lost)
            first = PageStatus(st[bad[0]]).name
            detail = job.errors[0] if job.errors else f"page {bad[0]} {first}"
            t.error = f"L3 {job.op}: {len(bad)} of {len(st)} pages not {'stored' if job.op == 'write' else 'read'}"
            t.error += f" ({len(lost)} lost from the store): {detail}" if lost else f": {detail}"
        else:
            self.counts["extents"] += job.extents
        if len(bad) > len(lost) or not bad:  # pages only gone from a shared store say neither
            self._note_health(t.error if bad else None)
        self._active.discard(job)
        job.outcome = not bad
        job.event.set()

    def _note_health(self, error: str | None) -> None:
        """Under the lock, as a job ends: say when the store starts failing (pages neither
        stored nor read, not merely gone from a shared store), again at most every
        :data:`FAILING_WARN_S` while it goes on, and when it works again. A store that fails
        by status (a remote store whose server went away) raises nothing: without this the
        only sign was requests recomputing."""
        if error is None:
            if self._failing and self._warned_streak:
                log.warning(
                    "hicache L3: the %s store works again after %d failed requests", self.store.kind, self._failing
                )
            self._failing, self._warned_streak = 0, False
            return
        self._failing += 1
        now = time.monotonic()
        # NOTE: across streaks too: a store that fails every other request logs once per period
        if now - self._warned_at >= FAILING_WARN_S:
            self._warned_at, self._warned_streak = now, True
            log.warning(
                "hicache L3: %s store failing (%d requests in a row): %s", self.store.kind, self._failing, error
            )

    def _close_store(self) -> None:
        with self._lock:
            if self._store_closed:
                return
            self._store_closed = True
        try:
            self.store.close()
        except Exception as exc:
            log.warning("hicache L3: closing the %s store failed: %s", self.store.kind, exc)
        finally:
            self._store_gone.set()  # NOTE: after the store's close returned: what the exit waits for

    # -- exists on a remote store ------------------------------------------------------------------

    def _exists_failed(self, exc: BaseException) -> int:
        self.counts["exists_failed"] += 1
        log.warning("hicache L3 exists failed: %s", exc)
        return 0

    def _exists_remote(self, keys: list[bytes]) -> int:
        """Through one control thread, so a hung store costs at most ``exists_timeout_s``
        once and 0 (at once) while that call is still stuck."""
        with self._lock:
            if self._exists_busy:
                self.counts["exists_timeouts"] += 1
                return 0
            self._exists_busy = True
            if self._control is None:
                self._control = queue.SimpleQueue()
                threading.Thread(target=self._control_loop, args=(self._control,), daemon=True).start()
        box: list[int] = []
        done = threading.Event()
        self._control.put((keys, box, done))
        if not done.wait(self.exists_timeout_s):
            self.counts["exists_timeouts"] += 1
            return 0
        return box[0] if box else 0

    def _control_loop(self, q: queue.SimpleQueue[tuple[list[bytes], list[int], threading.Event]]) -> None:
        while True:
            keys, box, done = q.get()
            try:
                box.append(_held(self.store.exists(keys), len(keys)))
            except Exception as exc:
                self._exists_failed(exc)
            finally:
                with self._lock:
                    self._exists_busy = False
                done.set()


def _check_keys(keys: Sequence[bytes], n: int) -> None:
    # NOTE: C-level checks first: this runs on the scheduler thread for every request.
    if len(keys) != n:
        raise MisuseError(f"{len(keys)} keys for {n} pages")
    if n and (set(map(type, keys)) != {bytes} or set(map(len, keys)) != {KEY_BYTES}):
        raise MisuseError(f"keys must be {KEY_BYTES}-byte bytes (hicache.core.keys.page_keys)")


_MAX_WAIT_S = 1e9


def check_mover_config(
    slots: int,
    workers: int,
    deadline_s: float | None,
    deadline_s_per_gib: float,
    close_timeout_s: float,
    exists_pages: int,
    exists_timeout_s: float,
) -> None:
    """Raise ConfigError for any bad mover setting (before anything is opened)."""
    for name, value in (("L3 slots", slots), ("storage workers", workers), ("exists_pages", exists_pages)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive int, got {value!r}")
    for name, x in (
        ("deadline_s", deadline_s),
        ("deadline_s_per_gib", deadline_s_per_gib),
        ("close_timeout_s", close_timeout_s),
        ("exists_timeout_s", exists_timeout_s),
    ):
        if x is None and name == "deadline_s":
            continue
        # NOTE: waits on these time out through threading, which refuses more than TIMEOUT_MAX
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= _MAX_WAIT_S:
            raise ConfigError(f"{name} must be a non-negative number of seconds up to 1e9, got {x!r:.60}")


def _check_chunks(chunks: object, n: int) -> None:
    """Raise ValueError unless ``chunks`` (a store's plan) are ``(a, b)`` int pairs that cover
    ``[0, n)`` in order, each non-empty: a run of a job over anything else would index pages
    it does not have, or leave some never done."""
    at = 0
    for chunk in chunks if isinstance(chunks, (list, tuple)) else ():
        a, b = chunk
        if type(a) is not int or type(b) is not int or a != at or b <= a:
            break
        at = b
    else:
        if at == n and n > 0 and isinstance(chunks, (list, tuple)):
            return
    raise ValueError(f"the store's plan {chunks!r:.200} does not cover pages 0..{n - 1} in order")
