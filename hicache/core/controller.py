"""The controller: write-through and restore lifecycles over the core and two movers.

Engine-facing, engine-agnostic; talks to backends only through :mod:`hicache.core.protocols`.
A request's life::

    req = c.admit(tokens)           match; pin the L1 prefix; req.cached_len = L1 hit
    plan = c.plan(req)              policy / cost model: restore from L2, L3, or recompute
    r = c.start_restore(req, plan)  S2H (L3 only) then H2D, asynchronous; advance with
    c.poll()                        c.poll() (or c.restore(req) to block). req.cached_len
                                    moves only after the H2D completed AND was published
    pages = c.allocate(req, n)      private L1 pages for the uncached part (evicts; None if
                                    no room can be made)
    c.insert(req, pages)            after prefill: the tree adopts them; write-through runs
    c.release(req)                  done or aborted: private pages freed, pins released

Ownership during a restore: the source path is pinned for the whole operation; destination
pages are private to the transfer until it completes; promoted L2 pages belong to the tree
once the S2H is published (a later failure, e.g. no L1 room for the H2D, never returns them
to the free list). Any failure: only still-private pages are freed, pins released, the
request recomputes, ``metrics.fallbacks`` counts it.

Threading: one scheduler thread calls the controller (checked); backends run their own I/O
threads and streams.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, cast

from hicache.core.cache import CacheCore
from hicache.core.cost import CostModel, Plan
from hicache.core.geometry import DevicePage
from hicache.core.metrics import Metrics
from hicache.core.node import Lease, Node, Transfer
from hicache.core.protocols import DeviceMover, StorageMover, TicketLike
from hicache.core.status import ControllerStatus
from hicache.core.tokens import as_tokens
from hicache.errors import ConfigError, HandleError, MisuseError
from hicache.spec.model import Direction, Tier


class WritePolicy(StrEnum):
    WRITE_THROUGH = "write_through"  # back up every inserted prefix (default)
    SELECTIVE = "write_through_selective"  # back up a prefix once it was hit N times
    WRITE_BACK = "write_back"  # back up a prefix when it is evicted from L1 (synchronously)


@dataclass(eq=False)
class Request:
    """One engine request as the controller sees it. ``cached_len`` (page aligned) is the
    prefix whose KV is usable in L1 now; it only grows after a restore is published."""

    id: int
    tokens: tuple[int, ...]
    hit: tuple[int, int, int]
    cached_len: int
    lease: Lease | None
    private: list[DevicePage] = field(default_factory=list)
    restore: PendingRestore | None = None
    released: bool = False


@dataclass(eq=False)
class PendingRestore:
    request: Request
    plan: Plan
    stage: Literal["s2h", "h2d", "done", "failed", "cancelled"]
    started: float
    error: str | None = None
    overlapped_s: float = 0.0
    # Set when the H2D started with layer events (``start_restore(layer_events=...)``): the
    # L1 pages the request's prefix will have once published, in token order, which the
    # device fills layer by layer. Reading them is for the requester only, on the device,
    # each layer after its event; the host publishes them (and anyone else may read them)
    # only when the whole transfer succeeded. On failure the reader discards what it read.
    pages: list[DevicePage] | None = None

    @property
    def layered(self) -> bool:
        """The H2D is in flight and signals each layer as it lands."""
        return self.pages is not None

    @property
    def finished(self) -> bool:
        return self.stage in ("done", "failed", "cancelled")


@dataclass(eq=False)
class _Job:
    transfer: Transfer
    ticket: TicketLike
    restore: PendingRestore | None  # None: a write-through backup


class Controller:
    """See the module docstring. Construct through :class:`hicache.HiCache` normally."""

    def __init__(
        self,
        core: CacheCore,
        device: DeviceMover,
        storage: StorageMover | None,
        cost: CostModel,
        *,
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        selective_hits: int = 2,
        bytes_per_page: int,
    ) -> None:
        try:
            self.write_policy = WritePolicy(write_policy)
        except ValueError:
            raise ConfigError(
                f"write_policy must be one of {[p.value for p in WritePolicy]}, got {write_policy!r}"
            ) from None
        if selective_hits < 1:
            raise ConfigError(f"selective_hits must be >= 1, got {selective_hits}")
        if core.sizes.l3_pages and storage is None:
            raise ConfigError("L3 pages configured but no storage backend given")
        self.core = core
        self.device = device
        self.storage = storage
        self.cost = cost
        self.selective_hits = selective_hits
        self.bytes_per_page = bytes_per_page
        self.metrics = Metrics()
        self._jobs: dict[int, _Job] = {}
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count(1)
        self._hits: dict[int, int] = {}
        self._owner = threading.get_ident()
        self.closed = False

    # -- guards ------------------------------------------------------------------------------

    def _enter(self) -> None:
        if self.closed:
            raise MisuseError("this HiCache is closed")
        if threading.get_ident() != self._owner:
            raise MisuseError("HiCache is single-threaded: call it from the thread that created it")

    def _live(self, req: Request) -> None:
        if req.released or self._requests.get(req.id) is not req:
            raise HandleError(f"request #{req.id} was released or is unknown")

    # -- requests ----------------------------------------------------------------------------

    def admit(self, tokens: object) -> Request:
        """Match ``tokens`` (changes no residency) and pin the L1 hit for a new request."""
        self._enter()
        toks = as_tokens(tokens)
        hit = self.core.match_valid(toks)
        lease = self.core.lock(hit.l1) if hit.l1.length else None
        req = Request(next(self._ids), toks, hit.lengths, hit.l1.length, lease)
        self._requests[req.id] = req
        self.metrics.hit_tokens["L1"] += hit.l1.length
        if hit.l1.length and self.write_policy is WritePolicy.SELECTIVE:
            node = hit.l1.node
            self._hits[node.id] = self._hits.get(node.id, 0) + 1
            if self._hits[node.id] >= self.selective_hits:
                self._backup(node)
        return req

    def plan(self, req: Request) -> Plan:
        """Where to restore from, by the policy and cost model (a decision only)."""
        self._enter()
        self._live(req)
        n1, n2, n3 = self.core.match_valid(req.tokens).lengths
        if self.storage is None:
            n3 = 0
        plan = self.cost.decide(n1, n2, n3)
        if plan.tier is Tier.L1 and max(n2, n3) > n1:
            self.metrics.policy_skips += 1
        return plan

    def prefix_pages(self, req: Request) -> list[DevicePage]:
        """The L1 pages holding ``req.tokens[:req.cached_len]``, in order."""
        self._live(req)
        if req.lease is None:
            return []
        hit = self.core.match_valid(req.tokens).l1
        return self.core.pages_l1(hit)[: req.cached_len // self.core.page_size]

    def allocate(self, req: Request, n: int) -> list[DevicePage] | None:
        """``n`` private L1 pages for ``req`` (evicting unpinned L1 copies as needed), or
        None, changing nothing, if no room can be made."""
        self._enter()
        self._live(req)
        if not self._ensure_free(Tier.L1, n):
            return None
        pages = self.core.allocate_l1(n)
        if pages is not None:
            req.private.extend(pages)
        return pages

    def insert(self, req: Request, pages: Sequence[DevicePage]) -> int:
        """After prefill: hand ``req``'s pages for ``tokens[cached_len:]`` (page aligned) to
        the tree. Returns the new ``cached_len``: :meth:`prefix_pages` now gives the tree's
        pages for ``[0, cached_len)`` (our duplicates of pages the tree already had are
        freed). Where the tree refuses pages (a transfer into that run is in flight),
        ``cached_len`` stays short of the prompt and those pages remain the request's own:
        the engine reads ``pages[(cached_len - first) // page_size:]`` of what it passed,
        ``first`` being the token position of ``pages[0]``. Write-through starts per the
        write policy."""
        self._enter()
        self._live(req)
        ps = self.core.page_size
        aligned = len(req.tokens) - len(req.tokens) % ps
        own = list(pages)
        mine = set(req.private)
        if any(p not in mine for p in own):
            raise MisuseError("insert: pages must be private pages allocated for this request")
        prefix = self.prefix_pages(req)
        need = aligned // ps - len(prefix)
        if len(own) < need:
            raise MisuseError(f"insert needs {need} pages for tokens [{req.cached_len}, {aligned}), got {len(own)}")
        start = len(prefix)
        recomputed = aligned - req.cached_len
        result = self.core.insert(req.tokens[:aligned], prefix + own[:need])
        self._repin(req)
        # Positions below the new match hold the tree's L1 pages: ours were adopted there,
        # or are duplicates (freed). Above it the tree refused our pages (its run there has a
        # transfer in flight): they stay private, and the request keeps reading them.
        covered = own[: max(0, req.cached_len // ps - start)]
        duplicates = set(result.rejected) & set(covered)
        self.core.free_private(list(duplicates))
        gone = set(covered)
        req.private = [p for p in req.private if p not in gone]
        self.metrics.recomputed_tokens += max(0, recomputed)
        if self.write_policy is WritePolicy.WRITE_THROUGH and result.node.parent is not None:
            self._backup(result.node)
        return req.cached_len

    def release(self, req: Request) -> None:
        """The request finished or was aborted: free its private pages, drop its pins. A
        restore in flight completes in the background (its pages go to the tree) without
        touching the request."""
        self._enter()
        self._live(req)
        req.released = True
        del self._requests[req.id]
        if req.private:
            self.core.free_private(req.private)
            req.private = []
        if req.lease is not None:
            self.core.release(req.lease)
            req.lease = None

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Teach the recompute model: ``tokens`` new tokens were prefilled in ``seconds``."""
        self.cost.observe_prefill(tokens, seconds)

    def note_decode(self, seconds: float) -> None:
        """The engine ran a decode batch for ``seconds`` while restores were pending."""
        pending = [j.restore for j in self._jobs.values() if j.restore is not None]
        for r in dict.fromkeys(pending):
            if r is not None:
                r.overlapped_s += seconds

    # -- restore -----------------------------------------------------------------------------

    def start_restore(
        self, req: Request, plan: Plan | None = None, *, layer_events: Sequence[Any] | None = None
    ) -> PendingRestore | None:
        """Begin restoring ``req``'s prefix per ``plan`` (default: :meth:`plan`). Returns
        None when there is nothing to restore or it cannot start (counted as fallback).

        ``layer_events`` (one per layer; an empty sequence on CPU) asks an L2 restore's H2D
        to record ``layer_events[l]`` once layer ``l`` has landed; the restore then carries
        ``pages`` (:class:`PendingRestore`) so the engine can start the request's forward
        before publication. An L3 restore ignores it (its H2D starts at a later poll)."""
        self._enter()
        self._live(req)
        if req.restore is not None and not req.restore.finished:
            raise MisuseError(f"request #{req.id} already has a restore in flight")
        plan = plan or self.plan(req)
        if plan.tier is Tier.L1 or plan.tokens <= req.cached_len:
            return None
        hit = self.core.match_valid(req.tokens)
        restore = PendingRestore(req, plan, "s2h" if plan.tier is Tier.L3 else "h2d", time.perf_counter())
        req.restore = restore
        if plan.tier is Tier.L3 and hit.l3.length > hit.l2.length:
            started = self._start(Direction.S2H, hit.l3.node, restore)
        else:
            restore.stage = "h2d"
            started = self._start(Direction.H2D, hit.l2.node, restore, layer_events)
        if not started:
            self._fail(restore, "could not start (no room or a transfer already in flight)")
            return None
        return restore

    def restore(self, req: Request, plan: Plan | None = None) -> bool:
        """Blocking restore (engines without an overlap loop). True if ``cached_len`` grew."""
        pending = self.start_restore(req, plan)
        if pending is None:
            return False
        while not pending.finished:
            job = next((j for j in self._jobs.values() if j.restore is pending), None)
            if job is None:
                break
            job.ticket.wait()
            self.poll()
        return pending.stage == "done"

    def poll(self) -> list[PendingRestore]:
        """Advance every transfer in flight; returns restores that finished in this call."""
        self._enter()
        finished: list[PendingRestore] = []
        for job in list(self._jobs.values()):
            if job.ticket.poll():
                restore = self._finish(job)
                if restore is not None and restore.finished:
                    finished.append(restore)
        return finished

    # -- internals ---------------------------------------------------------------------------

    def _mover(self, direction: Direction) -> Any:
        if direction in (Direction.D2H, Direction.H2D):
            return getattr(self.device, direction.name.lower())
        assert self.storage is not None
        return self.storage.write if direction is Direction.H2S else self.storage.read

    def _start(
        self,
        direction: Direction,
        node: Node,
        restore: PendingRestore | None,
        layer_events: Sequence[Any] | None = None,
    ) -> bool:
        core = self.core
        if not node.alive or not core.can_start(direction, node):
            return False
        need = sum(len(n.pages[direction.source] or ()) for n in core.segment(direction, node))
        if not self._ensure_free(direction.target, need):
            return False
        transfer = core.start(direction, node)
        if transfer is None:
            return False
        try:
            if layer_events is None:
                ticket = self._mover(direction)(transfer.src, transfer.dst)
            else:
                ticket = self.device.h2d(transfer.src, transfer.dst, layer_events=layer_events)
        except BaseException:
            core.fail(transfer)
            raise
        self._jobs[transfer.id] = _Job(transfer, ticket, restore)
        if layer_events is not None and restore is not None:
            restore.pages = self._l1_path(transfer.nodes[0].parent) + cast(list[DevicePage], transfer.dst)
        return True

    @staticmethod
    def _l1_path(node: Node | None) -> list[DevicePage]:
        """The L1 pages of the root..``node`` path, in token order (all L1-resident)."""
        runs: list[Sequence[int]] = []
        while node is not None and node.parent is not None:
            pages = node.pages[Tier.L1]
            assert pages is not None  # the H2D's destination parent is pinned in L1
            runs.append(pages)
            node = node.parent
        return cast(list[DevicePage], [p for run in reversed(runs) for p in run])

    def _ensure_free(self, tier: Tier, n: int) -> bool:
        """Evict in ``tier`` until ``n`` pages are free. Under write_back, an L1 victim
        without an L2 copy is first backed up (D2H, waited for) so its prefix survives."""
        core = self.core
        if tier is not Tier.L1 or self.write_policy is not WritePolicy.WRITE_BACK or not core.sizes.l2_pages:
            return core.ensure_free(tier, n)
        if not core.can_make_room(tier, n):
            return False
        while core.l1.num_free < n:
            victim = core.tree.pop_lru(Tier.L1)
            if victim is None:
                break
            core.tree.push_candidate(victim, Tier.L1)  # pop_lru took it out of the index
            if not victim.has(Tier.L2) and core.can_start(Direction.D2H, victim):
                if self._start(Direction.D2H, victim, None):
                    job = next(j for j in self._jobs.values() if victim in j.transfer.nodes)
                    job.ticket.wait()
                    self._finish(job)
                else:
                    self.metrics.backups_skipped += 1
            core.evict(Tier.L1, n - core.l1.num_free)
        return core.l1.num_free >= n

    def _backup(self, node: Node) -> None:
        if not self.core.sizes.l2_pages or not node.alive:
            return
        if node.has(Tier.L2):
            self._backup_l3(node)
            return
        if self.core.can_start(Direction.D2H, node) and not self._start(Direction.D2H, node, None):
            self.metrics.backups_skipped += 1

    def _backup_l3(self, node: Node) -> None:
        if self.storage is None or not node.alive or node.has(Tier.L3):
            return
        if self.core.can_start(Direction.H2S, node) and not self._start(Direction.H2S, node, None):
            self.metrics.backups_skipped += 1

    def _account(self, job: _Job, ok: bool) -> None:
        d = job.transfer.direction
        stats = self.metrics.directions[d.name]
        t = job.ticket.timings
        if not ok:
            stats.failed += 1
            return
        stats.count += 1
        stats.bytes += job.ticket.nbytes
        stats.steady_s += t.recurring_s
        stats.enqueue_s += t.enqueue_s
        stats.setup_s += t.setup_s
        stats.queue_s += t.queue_s
        stats.service_s += t.service_s
        stats.total_s += t.total_s
        stats.extents += job.ticket.extents
        self.cost.observe_transfer(d, job.ticket.nbytes, t.recurring_s)

    def _finish(self, job: _Job) -> PendingRestore | None:
        del self._jobs[job.transfer.id]
        transfer, restore = job.transfer, job.restore
        ok = bool(job.ticket.ok)
        error = job.ticket.error
        if ok and (error := self._verify(transfer)) is not None:
            ok = False
            self.metrics.verify_failures += 1
        self._account(job, ok)
        if not ok:
            self.core.fail(transfer)
            if restore is not None:
                self._fail(restore, error or "transfer failed")
            return restore
        self.core.complete(transfer)  # NOTE: publish first; only then may anyone read it
        bottom = transfer.nodes[-1]
        if restore is None:
            if transfer.direction is Direction.D2H:
                self._backup_l3(bottom)
            return None
        req = restore.request
        if transfer.direction is Direction.S2H:
            self.metrics.promotions += len(transfer.nodes)
            # The promoted L2 pages now belong to the tree, whatever happens next.
            if req.released:
                restore.stage = "cancelled"
                return restore
            restore.stage = "h2d"
            if not self._start(Direction.H2D, bottom, restore):
                self._fail(restore, "no L1 room for the H2D after promotion")
            return restore
        if req.released:
            restore.stage = "cancelled"
            return restore
        before = req.cached_len
        self._repin(req)
        restore.stage = "done"
        elapsed = time.perf_counter() - restore.started
        self.metrics.restores += 1
        self.metrics.restore_s += elapsed
        self.metrics.restore_overlapped_s += min(restore.overlapped_s, elapsed)
        tier = restore.plan.tier.name
        self.metrics.hit_tokens[tier] += max(0, req.cached_len - before)
        return restore

    def _verify(self, transfer: Transfer) -> str | None:
        """Check a finished transfer's destination pages before they are published; an
        error message fails the transfer (the request recomputes). The controller knows no
        bytes; :class:`hicache.HiCache` checks page digests when ``verify_pages`` is set."""
        return None

    def _fail(self, restore: PendingRestore, why: str) -> None:
        restore.stage = "failed"
        restore.error = why
        self.metrics.fallbacks += 1

    def _repin(self, req: Request) -> None:
        """Move the request's L1 pin to its current (published) L1 match."""
        hit = self.core.match_valid(req.tokens).l1
        lease = self.core.lock(hit) if hit.length else None
        if req.lease is not None:
            self.core.release(req.lease)
        req.lease = lease
        req.cached_len = hit.length

    # -- observability and shutdown ----------------------------------------------------------

    def status(self) -> ControllerStatus:
        """Capacity/free/protected/evictable per tier, pending work, backends, cost model,
        metrics; typed (``.to_dict()`` for JSON)."""
        return ControllerStatus(
            core=self.core.status(),
            pending_backups=sum(1 for j in self._jobs.values() if j.restore is None),
            pending_restores=sum(1 for j in self._jobs.values() if j.restore is not None),
            requests=len(self._requests),
            write_policy=self.write_policy.value,
            transfer=self.device.status(),
            storage=None if self.storage is None else self.storage.status(),
            cost_model=self.cost.state(),
            metrics=self.metrics.to_dict(),
        )

    def prometheus(self) -> str:
        return self.metrics.prometheus({t.name: self.core.evictions[t] for t in Tier})

    def check_integrity(self) -> None:
        self.core.check_integrity()

    def drain(self) -> None:
        """Block until every transfer in flight (backups and restores) has finished."""
        self._enter()
        while self._jobs:
            for job in list(self._jobs.values()):
                job.ticket.wait()
            self.poll()

    def close(self) -> None:
        """Drain every transfer in flight (completing or failing it), release every request,
        close storage. Afterwards every call raises MisuseError."""
        if self.closed:
            return
        self.drain()
        for req in list(self._requests.values()):
            self.release(req)
        if self.storage is not None:
            self.storage.close()
        self.closed = True
