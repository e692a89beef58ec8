"""The controller: requests, restores and write-through over the core and two movers.

The contract with an engine, a handful of calls (engine-agnostic; backends are reached only
through :mod:`hicache.core.protocols`)::

    req = c.admit(tokens)           match once; pin the L1 hit (req.cached_len, req.pages)
    plan = c.plan(req)              restore from L2, L3, or recompute (a decision only)
    r = c.start_restore(req, plan)  commit it: pin the source, make room, allocate, issue;
                                    None when there is nothing to restore or it cannot start
    c.poll()                        advance transfers; a restore publishes, then cached_len grows
    pages = c.allocate(req, n)      n private L1 pages, evicting as needed; None if no room
    c.insert(req, pages)            after prefill: the tree adopts the aligned prompt
    c.release(req)                  finished or aborted: the request holds nothing afterwards

What a request may do in which state is :mod:`hicache.spec.request`; every call checks it and
raises :class:`MisuseError`, changing nothing, when it refuses. A request is matched against
the tree twice in its life (``admit`` and ``insert``); everything else works from what it
holds: its match, its leases, its L1 page list.

Ownership during a restore: the request pins the run it reads (L3, then L2) from the commit
until the transfer ends, so nothing that makes room can evict it; destination pages are
private to the transfer until it completes; promoted L2 pages belong to the tree once the
S2H is published. Any failure: only still-private pages are freed, pins released, the
request recomputes, ``metrics.fallbacks`` counts it.

Threading: one scheduler thread calls the controller (checked on every call).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hicache.core.cache import CacheCore
from hicache.core.cost import CostModel, Plan
from hicache.core.geometry import DevicePage
from hicache.core.interrupts import atomic, from_signal, held, hold_signals, interruptible, release_signals
from hicache.core.keys import page_keys
from hicache.core.metrics import Levels, Metrics
from hicache.core.node import Lease, Node, Transfer
from hicache.core.protocols import DeviceMover, PageVerifier, StorageMover, StorageTicketLike, TicketLike
from hicache.core.status import ControllerStatus
from hicache.core.tokens import as_tokens, plain_int
from hicache.core.tree import MatchResult, TierMatch
from hicache.errors import (
    ConfigError,
    HandleError,
    HiCacheError,
    IntegrityError,
    MisuseError,
    PageOwnershipError,
    TransitionRefused,
)
from hicache.spec.invariants import Violation, check_all
from hicache.spec.model import Direction, Tier
from hicache.spec.request import ReqEvent, ReqState, request_step
from hicache.spec.request_invariants import check_requests
from hicache.spec.snapshot import RequestView, Snapshot

log = logging.getLogger(__name__)


class WritePolicy(StrEnum):
    WRITE_THROUGH = "write_through"  # back up every inserted prefix (default)
    SELECTIVE = "write_through_selective"  # back up a prefix once it was hit N times
    WRITE_BACK = "write_back"  # back up a prefix when it is evicted from L1 (synchronously)


class Stage(StrEnum):
    """A restore's stage: in flight (``S2H``, ``H2D``) or finished (an :class:`Outcome`)."""

    S2H = "s2h"
    H2D = "h2d"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Outcome(StrEnum):
    """How a restore ended."""

    DONE = "done"  # published: the request's cached_len grew
    FAILED = "failed"  # the request recomputes
    CANCELLED = "cancelled"  # its request was released first; what landed went to the tree


@dataclass(eq=False, slots=True)
class Request:
    """One engine request as the controller sees it.

        tokens  [0 ........ cached_len) [cached_len ........ aligned) tail
                 pages: tree's L1 pages   private pages, after allocate   (< a page)
                 pinned by ``lease``

    ``cached_len`` is page aligned; it grows only when a restore publishes, and moves to
    what the tree holds when the prompt is inserted.
    """

    id: int
    tokens: tuple[int, ...]
    match: MatchResult  # per-tier hits at admission
    state: ReqState = ReqState.ADMITTED
    cached_len: int = 0
    pages: list[DevicePage] = field(default_factory=list)
    lease: Lease | None = None
    private: list[DevicePage] = field(default_factory=list)
    restore: PendingRestore | None = None
    # write_through_selective: the L1 prefix that reached its hits at admission, backed up
    # once the request inserts or releases (admit says why)
    selective: Node | None = None

    @property
    def hit(self) -> tuple[int, int, int]:
        """Per-tier hit lengths at admission."""
        return self.match.lengths

    @property
    def released(self) -> bool:
        return self.state is ReqState.RELEASED


@dataclass(eq=False)
class PendingRestore:
    """A committed restore of ``request``'s prefix up to ``plan.tokens``.

    ``pages`` is set when the H2D started with layer events (``start_restore(layer_events=
    ...)``): exactly the L1 pages of ``[0, plan.tokens)`` once published, which the device
    fills layer by layer. Reading them is for the requester only, on the device, each layer
    after its event; anyone else may read them only after publication. On failure the
    reader discards what it read.
    """

    request: Request
    plan: Plan
    started: float
    source: Lease | None = None  # the request's pin on the run being read (L3, then L2)
    transfer: Transfer | None = None  # the transfer in flight (S2H, then H2D)
    outcome: Outcome | None = None
    error: str | None = None
    overlapped_s: float = 0.0
    layer_pages: tuple[DevicePage, ...] | None = None  # what ``pages`` copies (the caller's to change)

    @property
    def pages(self) -> list[DevicePage] | None:
        """The L1 pages of a layered restore (class docstring), a new list on every read: an
        engine may build its page table from it (append its tail pages) without changing
        what is published."""
        return None if self.layer_pages is None else list(self.layer_pages)

    @property
    def layered(self) -> bool:
        """The H2D is in flight and signals each layer as it lands."""
        return self.layer_pages is not None

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    @property
    def done(self) -> bool:
        """Published: the request's cached_len grew."""
        return self.outcome is Outcome.DONE

    @property
    def stage(self) -> Stage:
        """Where the restore is: reading L3 (S2H), loading L1 (H2D), or its outcome."""
        if self.outcome is not None:
            return Stage(self.outcome.value)
        return Stage.S2H if self.transfer is not None and self.transfer.direction is Direction.S2H else Stage.H2D


@dataclass(eq=False, slots=True)
class _Job:
    transfer: Transfer
    ticket: TicketLike
    restore: PendingRestore | None  # None: a backup
    l3: StorageTicketLike | None = None  # the same ticket, when it is an L3 one
    broken: str | None = None  # the ticket raised: the transfer failed (a mover's bug)


class Controller:
    """See the module docstring. :class:`hicache.HiCache` builds one over real backends."""

    def __init__(
        self,
        core: CacheCore,
        device: DeviceMover,
        storage: StorageMover | None,
        cost: CostModel,
        *,
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        selective_hits: int = 2,
        verifier: PageVerifier | None = None,
        key_seed: bytes | None = None,
    ) -> None:
        self.write_policy = parse_write_policy(write_policy)
        check_selective_hits(selective_hits)
        if core.sizes.l3_pages and storage is None:
            raise ConfigError("L3 pages configured but no storage backend given")
        if storage is not None and storage.keyed and key_seed is None:
            raise ConfigError("a keyed L3 store needs the pages' key seed (the model's identity)")
        self.core = core
        self.device = device
        self.storage = storage
        self.cost = cost
        self.selective_hits = selective_hits
        self.verifier = verifier
        self.key_seed = key_seed
        self.metrics = Metrics()
        self._jobs: dict[int, _Job] = {}
        self._requests: dict[int, Request] = {}
        self._deferred: dict[tuple[int, Direction], Node] = {}  # backups waiting for a transfer above them
        self._lost: dict[int, Node] = {}  # runs a shared store lost, forgotten once nothing reads them
        self._stragglers: dict[int, _Job] = {}  # L3 I/O past its deadline, still running
        self._never_fits: set[Tier] = set()  # tiers already warned about a backup larger than all of them
        # Restores finished by drain() or another request's blocking restore(): the next
        # poll() reports them (an engine waiting for one would otherwise wait forever).
        self._unreported: list[PendingRestore] = []
        self._ids = itertools.count(1)
        self.request_coverage: Counter[tuple[ReqState, ReqEvent]] = Counter()  # transitions taken
        self._owner = threading.get_ident()
        self.closed = False
        self._storage_closing = False  # close() got as far as closing storage
        # NOTE: last: a refused construction holds nothing; one collected unclosed lets go
        self._signals: weakref.finalize[Any, Any] | None = None
        if hold_signals():
            self._signals = weakref.finalize(self, release_signals)
            self._signals.atexit = False

    # -- guards ------------------------------------------------------------------------------

    def _enter(self) -> None:
        if self.closed:
            raise MisuseError("this HiCache is closed")
        if threading.get_ident() != self._owner:
            raise MisuseError("HiCache is single-threaded: call it from the thread that created it")

    def _live(self, req: object, call: str) -> Request:
        if not isinstance(req, Request):
            raise MisuseError(f"{call}: expected a Request from admit(), got {type(req).__name__}")
        if req.released:
            again = "; release it once" if call == "release" else "; a request's last call is release"
            raise HandleError(f"{call}: request #{req.id} was released{again}")
        if self._requests.get(req.id) is not req:
            raise HandleError(f"{call}: request #{req.id} is not a request of this cache (admitted by another one)")
        return req

    def _next(self, req: Request, event: ReqEvent, call: str) -> ReqState:
        """The state ``event`` leads ``req`` to; MisuseError if the request model refuses it."""
        nxt = request_step(req.state, event)
        if nxt is None:
            wait = " (wait until poll() reports its restore)" if req.state in _RESTORING else ""
            raise MisuseError(
                f"{call}: request #{req.id} is {req.state.value}; {event.value!r} is not allowed there{wait}"
            )
        return nxt

    def _move(self, req: Request, event: ReqEvent, call: str) -> None:
        nxt = self._next(req, event, call)
        self.request_coverage[(req.state, event)] += 1
        req.state = nxt

    # -- requests ----------------------------------------------------------------------------

    @atomic
    def admit(self, tokens: object, *, at_most: int | None = None) -> Request:
        """Match ``tokens`` (one tree walk; changes no residency) and pin the L1 hit.
        ``at_most``: match (so pin and restore) only the pages within the first ``at_most``
        tokens; an engine that computes the last prompt token anyway passes ``len - 1``, so a
        fully cached page-aligned prompt does not pin (or restore) the last page it
        recomputes. :meth:`insert` still hands all the prompt's pages to the tree."""
        self._enter()
        toks = as_tokens(tokens)
        at_most = plain_int(at_most)  # type: ignore[assignment]
        if at_most is not None and (isinstance(at_most, bool) or not isinstance(at_most, int) or at_most < 0):
            raise MisuseError(f"admit: at_most must be None or an int >= 0, got {at_most!r}")
        match = self.core.match_valid(toks if at_most is None or at_most >= len(toks) else toks[:at_most])
        req = Request(next(self._ids), toks, match, cached_len=match.l1.length)
        if match.l1.length:
            # NOTE: pin the hit only: a hit ending inside a run splits it there (no residency
            # changes), so the run's pages past the hit stay evictable for this request's own.
            hit = self.core.trim(match.l1)
            req.lease = self.core.lock(hit)
            req.pages = self.core.pages_l1(hit)
        try:
            self._discover(req, len(toks) if at_most is None else at_most)
        except BaseException:
            # NOTE: a refusal (tokens a keyed store cannot name) leaves nothing pinned.
            if req.lease is not None:
                self.core.release(req.lease)
            raise
        self._requests[req.id] = req
        self.metrics.hit_tokens["L1"] += match.l1.length
        if req.lease is not None and self.write_policy is WritePolicy.SELECTIVE:
            node = req.lease.node
            node.hits += 1
            if node.hits >= self.selective_hits:
                n1, n2, n3 = req.match.lengths  # NOTE: after _discover: a shared store's pages too
                if self.storage is not None and self.storage.available and n3 > max(n1, n2):
                    # NOTE: an L2 copy needs its parent's (tiers are prefix-closed): a D2H of
                    # this L1 prefix begun now would refuse the request's own L3 restore of
                    # the pages below it, which reads them into L2 under it. Later, that
                    # restore has put the prefix in L2, or the backup starts unhindered.
                    req.selective = node
                else:
                    self._backup(node)
        return req

    def _discover(self, req: Request, at_most: int) -> None:
        """A prompt that misses past every local copy: ask a shared store (one batched,
        bounded ``exists``) how many of its pages within ``at_most`` tokens it holds, and
        record those as L3 runs."""
        storage, seed, ps = self.storage, self.key_seed, self.core.page_size
        if storage is None or seed is None or not storage.shared or not storage.keyed:
            return
        aligned = min(len(req.tokens), at_most) // ps
        if aligned <= max(req.match.lengths) // ps or not storage.available:
            return
        keys = page_keys(seed, req.tokens[: aligned * ps], ps)
        held = storage.exists(keys)
        if held * ps <= max(req.match.lengths):
            return
        before = self.core.l3.num_free
        known = self.core.path_pages(req.match.l3.node, Tier.L3) if self.verifier is not None else []
        l3 = self.core.discover(req.tokens, held, keys)
        self.metrics.l3_discovered_pages += max(0, before - self.core.l3.num_free)
        if self.verifier is not None:  # NOTE: a slot freed and found again holds another page now
            mine = set(known)
            self.verifier.forget_slots([s for s in self.core.path_pages(l3.node, Tier.L3) if s not in mine])
        if l3.length > req.match.l3.length:
            req.match = MatchResult(req.match.l1, req.match.l2, l3)

    def plan(self, req: Request) -> Plan:
        """Where to restore from, by the policy and cost model, from the admission match (a
        decision only; :meth:`start_restore` commits it or refuses)."""
        self._enter()
        self._live(req, "plan")
        if req.state is not ReqState.ADMITTED:
            raise MisuseError(f"plan: request #{req.id} is {req.state.value}; plan right after admit")
        n1, n2, n3 = req.match.lengths
        if self.storage is None or not self.storage.available:
            n3 = 0
        plan = self.cost.decide(n1, n2, n3)
        if plan.tier is Tier.L1 and max(n2, n3) > n1:
            self.metrics.policy_skips += 1
        return plan

    def prefix_pages(self, req: Request) -> list[DevicePage]:
        """The L1 pages holding ``req.tokens[:req.cached_len]``, in order (no tree walk)."""
        self._enter()
        self._live(req, "prefix_pages")
        return list(req.pages)

    @atomic
    def allocate(self, req: Request, n: int) -> list[DevicePage] | None:
        """``n`` private L1 pages for ``req`` (evicting unpinned L1 copies as needed), or
        None, changing nothing, if no room can be made now. More pages than L1 could ever
        give it (with those it holds already) is a MisuseError: waiting would never help."""
        self._enter()
        self._live(req, "allocate")
        n = plain_int(n)  # type: ignore[assignment]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise MisuseError(f"allocate: page count must be an int >= 0, got {n!r}")
        held, capacity = len(req.pages) + len(req.private), self.core.l1.capacity
        if n + held > capacity:
            raise MisuseError(
                f"allocate: {n} pages for request #{req.id}, which holds {held}, can never fit in L1's {capacity}"
            )
        self._next(req, ReqEvent.ALLOCATE, "allocate")
        if not self._make_room(Tier.L1, n):
            return None
        self._live(req, "allocate")  # NOTE: making room may wait on a mover that called release(req)
        pages = self.core.allocate_l1(n)
        if pages is None:
            return None
        req.private.extend(pages)
        self._move(req, ReqEvent.ALLOCATE, "allocate")
        return pages

    @atomic
    def insert(self, req: Request, pages: Sequence[DevicePage]) -> int:
        """After prefill: hand ``req``'s pages for ``tokens[cached_len:aligned]`` to the tree
        (``aligned``: the prompt rounded down to whole pages; a shorter prompt inserts
        nothing). Returns the new ``cached_len``; :meth:`prefix_pages` gives the tree's pages
        for ``[0, cached_len)`` (our duplicates of pages the tree already had are freed).
        Where the tree refuses pages (a restore into that run is in flight), ``cached_len``
        stays short of ``aligned`` and those pages remain the request's own. Write-through
        starts per the write policy. ``pages``: ints as :meth:`allocate` handed them out, or
        numpy integers, or a 1-D integer tensor or array."""
        self._enter()
        self._live(req, "insert")
        if _one_d_array(pages):  # an engine's page table row: a 1-D tensor or array of ids
            try:
                pages = pages.tolist()  # type: ignore[attr-defined]
            except (NotImplementedError, RuntimeError, TypeError, ValueError):  # meta, sparse, quantized
                raise MisuseError(
                    f"insert: pages must be ids this process can read, got a {type(pages).__name__} without values "
                    "here (meta, sparse or quantized)"
                ) from None
        if isinstance(pages, (str, bytes)) or not isinstance(pages, Sequence):
            raise MisuseError(f"insert: pages must be a sequence of page ids, got {type(pages).__name__}")
        self._next(req, ReqEvent.INSERT, "insert")
        ps = self.core.page_size
        aligned = len(req.tokens) - len(req.tokens) % ps
        given = [plain_int(p) for p in pages]  # numpy integers as the ints allocate() handed out
        mine = set(req.private)
        # NOTE: types first: set() of an unhashable id would raise a bare TypeError
        own = [DevicePage(p) for p in given if type(p) is int]
        if len(own) != len(given):
            odd = next(p for p in given if type(p) is not int)
            raise PageOwnershipError(f"insert: page ids must be ints, got {odd!r} ({type(odd).__name__})")
        if len(set(own)) != len(own) or not mine.issuperset(own):
            raise PageOwnershipError(
                f"insert: pages must be distinct private pages allocated for this request; {self._odd(req, own)}"
            )
        need = aligned // ps - req.cached_len // ps
        if len(own) < need:
            raise MisuseError(f"insert needs {need} pages for tokens [{req.cached_len}, {aligned}), got {len(own)}")
        if need == 0:
            self._move(req, ReqEvent.INSERT, "insert")
            self._selective_backup(req)
            return req.cached_len
        before = req.cached_len
        result = self.core.adopt(req.tokens[:aligned], [*req.pages, *own[:need]], len(req.pages))
        self._move(req, ReqEvent.INSERT, "insert")
        lease = None
        if result.length:
            lease = self.core.lock(TierMatch(Tier.L1, result.length, result.node, result.node.version[Tier.L1]))
        if req.lease is not None:
            self.core.release(req.lease)
        req.lease, req.cached_len, req.pages = lease, result.length, result.pages
        # Positions below the new cached_len hold the tree's L1 pages: ours were adopted
        # there, or are duplicates (freed). Above it the tree refused ours: they stay private.
        covered = own[: max(0, (result.length - before) // ps)]
        self.core.free_private(list(set(result.rejected) & set(covered)))
        gone = set(covered)
        req.private = [p for p in req.private if p not in gone]
        self.metrics.recomputed_tokens += aligned - before
        self._selective_backup(req)
        if self.write_policy is WritePolicy.WRITE_THROUGH and result.node.parent is not None:
            self._backup(result.node)
        elif self.write_policy is WritePolicy.SELECTIVE and set(result.rejected) & set(covered):
            # NOTE: pages the tree had already were recomputed, not matched: an engine admits
            # below the last prompt token, so a page-aligned prompt's last page is never a
            # hit. Reused all the same, they count as one, or that page is never backed up.
            result.node.hits += 1
            if result.node.hits >= self.selective_hits:
                self._backup(result.node)
        return req.cached_len

    def _odd(self, req: Request, pages: list[DevicePage]) -> str:
        """What is wrong with the first page of ``pages`` that ``req`` cannot insert."""
        seen: set[DevicePage] = set()
        mine = set(req.private)
        for p in pages:
            if p in seen:
                return f"page {p} is given twice"
            seen.add(p)
            if p in mine:
                continue
            if not 0 <= p < self.core.l1.capacity:
                return f"page {p} is outside L1's pages [0, {self.core.l1.capacity})"
            other = next((r.id for r in self._requests.values() if p in r.private), None)
            if other is not None:
                return f"page {p} is request #{other}'s"
            return f"page {p} was not allocated to request #{req.id} (free, or the tree's)"
        return "none is wrong"  # NOTE: cannot happen: called only when one is

    @atomic
    def release(self, req: Request) -> None:
        """The request finished or was aborted: free its private pages, drop its pins. A
        restore in flight completes in the background into the tree."""
        self._enter()
        self._live(req, "release")
        self._move(req, ReqEvent.RELEASE, "release")
        del self._requests[req.id]
        restore = req.restore
        if restore is not None and not restore.finished:
            job = None if restore.transfer is None else self._jobs.get(restore.transfer.id)
            if job is not None and self._cancel(job):  # not started: nothing will land
                del self._jobs[job.transfer.id]
                self.core.cancel(job.transfer)
                self._end_restore(restore, Outcome.CANCELLED, "released before its copy started")
        if restore is not None and restore.source is not None:
            self.core.release(restore.source)
            restore.source = None
        if req.private:
            self.core.free_private(req.private)
            req.private = []
        if req.lease is not None:
            self.core.release(req.lease)
            req.lease = None
        req.pages = []
        self._selective_backup(req)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Teach the recompute model: ``tokens`` new tokens were prefilled in ``seconds``."""
        self._enter()
        tokens = plain_int(tokens)  # type: ignore[assignment]
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 < tokens <= MAX_OBSERVED_TOKENS:
            raise MisuseError(f"observe_prefill: tokens must be an int in [1, 2**53], got {tokens!r:.60}")
        _check_seconds("observe_prefill", seconds)
        self.cost.observe_prefill(tokens, float(seconds))

    def note_decode(self, seconds: float, *, ended: float | None = None) -> None:
        """The engine ran a decode batch for ``seconds`` while restores were pending. With
        ``ended`` (the ``time.perf_counter()`` at which the batch ended), a restore started
        during the batch is credited only the part after its start (an engine may start
        restores beside a batch it launched: their host work overlaps it)."""
        self._enter()
        _check_seconds("note_decode", seconds)
        if ended is not None and (
            isinstance(ended, bool) or not isinstance(ended, (int, float)) or not abs(ended) < 1e300
        ):
            raise MisuseError(f"note_decode: ended must be a finite time.perf_counter() value, got {ended!r:.60}")
        for r in {id(j.restore): j.restore for j in self._jobs.values() if j.restore is not None}.values():
            if r is not None:
                part = seconds if ended is None else min(seconds, max(0.0, ended - r.started))
                r.overlapped_s += float(part)

    # -- restore -----------------------------------------------------------------------------

    @atomic
    def start_restore(
        self, req: Request, plan: Plan | None = None, *, layer_events: Sequence[Any] | None = None
    ) -> PendingRestore | None:
        """Commit ``plan`` (default: :meth:`plan`): pin the source run, make room, allocate,
        issue. Returns None when there is nothing to restore, or (counted as a fallback) when
        it cannot start; the request is then ready to prefill.

        ``layer_events`` (one per layer; an empty sequence on CPU) asks an L2 restore's H2D
        to record ``layer_events[l]`` once layer ``l`` has landed; the restore then carries
        ``pages`` so the engine can start the request's forward before publication. An L3
        restore ignores it (its H2D starts at a later poll)."""
        self._enter()
        self._live(req, "start_restore")
        if plan is not None and not isinstance(plan, Plan):
            raise MisuseError(f"start_restore: plan must be a Plan from plan(), got {type(plan).__name__}")
        events_ok = layer_events is None or (isinstance(layer_events, Sequence) and not isinstance(layer_events, str))
        if not events_ok:
            raise MisuseError(f"start_restore: layer_events must be a sequence, got {type(layer_events).__name__}")
        if layer_events:  # NOTE: checked here: the mover refused them only after room was made in L1
            groups = self.device.layer_groups()
            layers = groups[-1][1] if groups else len(layer_events)
            if len(layer_events) != layers:
                raise MisuseError(
                    f"start_restore: {len(layer_events)} layer_events for {layers} layers (give one per layer)"
                )
            # NOTE: a list, not next(..., None): a None among them is one to report
            bad = [e for e in layer_events if not callable(getattr(e, "record", None))][:1]
            if bad:
                raise MisuseError(f"start_restore: layer_events must be events (torch.cuda.Event), got {bad[0]!r:.60}")
        if req.state is not ReqState.ADMITTED:
            raise MisuseError(f"start_restore: request #{req.id} is {req.state.value}; restore right after admit")
        plan = plan or self.plan(req)
        if not isinstance(plan.tier, Tier) or isinstance(plan.tokens, bool) or not isinstance(plan.tokens, int):
            raise MisuseError(
                f"start_restore: a plan needs a Tier and an int of tokens, "
                f"got tier {plan.tier!r}, tokens {plan.tokens!r}"
            )
        ps = self.core.page_size
        if plan.tokens < 0 or (plan.tier is not Tier.L1 and plan.tokens % ps):
            raise MisuseError(f"start_restore: {plan} does not fit request #{req.id} (hits {req.match.lengths})")
        if plan.tier is Tier.L1 or plan.tokens <= req.cached_len:
            self._move(req, ReqEvent.SKIP, "start_restore")
            return None
        if plan.tokens > req.match[plan.tier].length or (plan.tier is Tier.L3 and not self.storage):
            raise MisuseError(f"start_restore: {plan} does not fit request #{req.id} (hits {req.match.lengths})")
        restore = PendingRestore(req, plan, time.perf_counter())
        if not self._commit(restore, layer_events):
            self._move(req, ReqEvent.SKIP, "start_restore")
            self.metrics.fallbacks += 1
            return None
        req.restore = restore
        return restore

    def _commit(self, restore: PendingRestore, layer_events: Sequence[Any] | None) -> bool:
        req, plan, core = restore.request, restore.plan, self.core
        m = req.match[plan.tier]
        if plan.tier is Tier.L3:
            self._await_backups_above(m.node)
        try:
            m = core.trim(TierMatch(m.tier, plan.tokens, m.node, m.version))
        except HandleError:
            return False  # the source copy went since admission
        node = m.node
        if plan.tier is Tier.L3 and node.has(Tier.L2):
            m = TierMatch(Tier.L2, plan.tokens, node, node.version[Tier.L2])  # promoted since: read L2
        direction = Direction.H2D if m.tier is Tier.L2 else Direction.S2H
        if not core.can_start(direction, node):
            return False  # the run changed since admission (restored or in flight elsewhere)
        restore.source = core.lock(m)
        try:
            job = self._start(direction, node, restore, layer_events if direction is Direction.H2D else None)
        except BaseException:
            core.release(restore.source)
            restore.source = None
            raise
        if job is None:
            core.release(restore.source)
            restore.source = None
            return False
        self._move(req, ReqEvent.START_L2 if direction is Direction.H2D else ReqEvent.START_L3, "restore")
        return True

    def _await_backups_above(self, node: Node) -> None:
        """An L3 restore reads its pages into L2 under their parent's L2 copy (tiers are
        prefix-closed), so a backup of a run above it still copying to L2 would refuse it,
        and the request would recompute every page below. Wait for such backups to land
        instead: device copies of pages in L1, short and bounded (no storage I/O is waited
        for). write_through_selective starts them at any admission that hits the run."""
        if not node.alive:
            return
        waited = False
        for n in self.core.segment(Direction.S2H, node):
            t = n.inflight[Direction.D2H]
            job = None if t is None else self._jobs.get(t.id)
            if job is not None:
                self._landed(job, block=True)
                waited = True
        if waited:
            self._collect()

    def restore(self, req: Request, plan: Plan | None = None) -> bool:
        """Blocking restore (engines without an overlap loop). True if ``cached_len`` grew."""
        pending = self.start_restore(req, plan)
        if pending is None:
            return False
        while not pending.finished:
            job = None if pending.transfer is None else self._jobs.get(pending.transfer.id)
            if job is None:
                raise IntegrityError("ordering", f"request #{req.id}", "a restore in flight has no transfer")
            self._landed(job, block=True)
            self._collect()
        self._unreported = [r for r in self._unreported if r is not pending]  # the caller has it
        return pending.outcome is Outcome.DONE

    def poll(self) -> list[PendingRestore]:
        """Advance every transfer in flight; returns the restores that finished since the
        last poll (in this call, or in a :meth:`drain` or another request's blocking
        :meth:`restore` in between), each once."""
        self._enter()
        self._collect()
        finished, self._unreported = self._unreported, []
        return finished

    def _collect(self) -> None:
        """Advance every transfer in flight; restores that finish wait for the next poll."""
        for job in list(self._jobs.values()):
            if self._landed(job):
                self._end_job(job)
        for job in list(self._stragglers.values()):
            if job.l3 is not None and job.l3.settled:  # its I/O returned: the pages are free again
                self._end_straggler(job)

    @atomic
    def _end_job(self, job: _Job) -> None:
        late = job.l3 is not None and job.broken is None and not job.l3.settled
        restore = job.restore
        try:
            restore = self._straggle(job) if late else self._finish(job)
        finally:
            # NOTE: also when a signal handler's exception cuts the work after the restore's
            # end short (the next copy's issue): a restore that ended is reported once
            if restore is not None and restore.finished and all(r is not restore for r in self._unreported):
                self._unreported.append(restore)

    @atomic
    def _end_straggler(self, job: _Job) -> None:
        del self._stragglers[job.transfer.id]
        self._jobs[job.transfer.id] = job
        self._finish(job)

    def settle(self) -> bool:
        """If every restore in flight is an H2D still copying, block until the first of them
        (the lowest transfer id: one device stream runs them in order) has landed, and
        return True; the next :meth:`poll` finishes it. Otherwise (or when its ticket had
        nothing to wait for) return False at once.

        For an engine with nothing else to run: polling a 20 ms copy every 50 us costs the
        scheduler thread hundreds of polls per restore. A restore still reading storage is
        never waited for (a hung disk must not wedge the caller), nor is a backup."""
        self._enter()
        first: _Job | None = None
        try:
            for job in self._jobs.values():
                if job.restore is None:
                    continue
                if job.transfer.direction is not Direction.H2D or job.ticket.ok is not None:
                    return False
                if first is None or job.transfer.id < first.transfer.id:
                    first = job
            settle = getattr(first.ticket, "settle", None) if first is not None else None
            return settle is not None and bool(settle())  # the ticket's settle: whether it waited
        except Exception as exc:  # a mover's bug: the next poll finds it, through _landed
            if from_signal(exc):
                raise  # NOTE: a signal handler's (a timeout's) while it waited: the caller's to hear
            log.warning("hicache: H2D ticket's settle (or ok) raised: %r", exc)
            return False

    def _landed(self, job: _Job, *, block: bool = False) -> bool:
        """Whether ``job``'s ticket has finished (``poll``; ``wait`` when ``block``). A ticket
        that raises is that transfer's failure, as a mover that raises on issue is: the
        exception never leaves the controller, and the request recomputes."""
        if job.broken is not None:
            return True
        name = job.transfer.direction.name
        try:
            if block:
                job.ticket.wait()
            if job.ticket.poll():
                return True
        except Exception as exc:
            if from_signal(exc):
                raise  # NOTE: a signal handler's (a timeout's) while it waited: the copy goes on
            log.warning("hicache: %s ticket raised: %r", name, exc)
            job.broken = f"the {name} ticket raised {exc!r}"
            return True
        if block:  # NOTE: the blocking loops would spin on it forever
            log.warning("hicache: %s ticket's wait returned before its copy finished", name)
            job.broken = f"the {name} ticket's wait returned before its copy finished"
        return block

    def _cancel(self, job: _Job) -> bool:
        """Withdraw ``job``'s copy if it has not started; a ticket whose ``cancel`` raises
        is taken to have started (its pages stay with the transfer until it finishes)."""
        try:
            return bool(job.ticket.cancel())
        except Exception as exc:
            if from_signal(exc):
                raise
            log.warning("hicache: %s ticket's cancel raised: %r", job.transfer.direction.name, exc)
            return False

    def _straggle(self, job: _Job) -> PendingRestore | None:
        """An L3 transfer failed by its deadline while its I/O still runs: the request
        recomputes now; the run keeps the transfer (its pages untouched) until the I/O returns."""
        del self._jobs[job.transfer.id]
        self._stragglers[job.transfer.id] = job
        self.metrics.l3_deadline_failures += 1
        restore, job.restore = job.restore, None
        if restore is not None and not restore.finished:
            self._end_restore(restore, Outcome.FAILED, job.ticket.error or "L3 deadline")
        return restore

    # -- internals ---------------------------------------------------------------------------

    def _start(
        self,
        direction: Direction,
        node: Node,
        restore: PendingRestore | None,
        layer_events: Sequence[Any] | None = None,
    ) -> _Job | None:
        """Start a transfer ending at ``node`` (pins, room, pages: :meth:`CacheCore.start`)
        and issue it; None if it cannot start or the mover refused it (counted)."""
        core = self.core
        transfer = core.start(direction, node, make_room=self._make_room)
        if transfer is None:
            return None
        l3: StorageTicketLike | None = None
        h2d: TicketLike | None = None
        try:
            with interruptible():  # NOTE: a mover may block; an interrupt here fails this transfer
                if direction is Direction.D2H:
                    ticket = self.device.d2h(transfer.src, transfer.dst)
                elif direction is Direction.H2D:
                    ticket = h2d = self.device.h2d(transfer.src, transfer.dst, layer_events=layer_events)
                elif self.storage is None:
                    raise IntegrityError("structure", repr(node), f"{direction.name} without storage")
                else:
                    if not self.storage.keyed:
                        io = self.storage.write if direction is Direction.H2S else self.storage.read
                        l3 = io(transfer.src, transfer.dst)
                    else:
                        keys, above = self._keys(transfer), self._above(transfer)
                        if direction is Direction.H2S:
                            l3 = self.storage.write(transfer.src, transfer.dst, keys, above=above)
                        else:
                            l3 = self.storage.read(transfer.src, transfer.dst, keys, above=above)
                    ticket = l3
        except BaseException as exc:
            # NOTE: a mover that could not issue, or an interrupt (Ctrl-C, a timeout's handler)
            # while it issued: no job will ever end this transfer, so it fails here (its pages
            # go back; the pools' fences order any copy the mover had queued before their next
            # use) and an interrupt goes on.
            if h2d is not None:
                # NOTE: one that came once the H2D was issued: its L1 pages go back to the pool,
                # and the engine's next forward on them is ordered by no fence: the copy first
                self._wait_quietly(h2d)
            core.fail(transfer)
            if isinstance(exc, HiCacheError):
                raise
            self.metrics.directions[direction.name].failed += 1
            if not isinstance(exc, Exception) or from_signal(exc):
                raise  # NOTE: a signal handler's (a timeout's) while the mover issued it: as an interrupt
            log.warning("hicache: %s could not be issued: %r", direction.name, exc)
            return None
        job = _Job(transfer, ticket, restore, l3 if direction in (Direction.H2S, Direction.S2H) else None)
        self._jobs[transfer.id] = job
        if restore is not None:
            restore.transfer = transfer
            if layer_events is not None and direction is Direction.H2D:
                restore.layer_pages = tuple(self._prefix_after(restore.request, transfer))
        return job

    @staticmethod
    def _wait_quietly(ticket: TicketLike) -> None:
        """Wait for ``ticket``'s copy to end, whatever its ticket says or raises."""
        try:
            ticket.wait()
        except Exception as exc:
            log.warning("hicache: an interrupted copy's ticket raised: %r", exc)

    def _keys(self, transfer: Transfer) -> list[bytes]:
        """The content keys of a transfer's pages (its runs', in order)."""
        assert self.key_seed is not None  # checked at construction for keyed stores
        return [k for n in transfer.nodes for k in self.core.page_keys(n, self.key_seed)]

    def _above(self, transfer: Transfer) -> list[bytes]:
        """The content keys of the pages before a transfer's on its path (a store that
        evicts by recency keeps a prompt's head at least as recent as its tail)."""
        assert self.key_seed is not None
        path: list[Node] = []
        node = transfer.nodes[0].parent
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        return [k for n in reversed(path) for k in self.core.page_keys(n, self.key_seed)]

    def _prefix_after(self, req: Request, transfer: Transfer) -> list[DevicePage]:
        """The L1 pages ``req``'s prefix will have once ``transfer`` (an H2D ending at its
        planned length) publishes: the path above the segment, then the segment's pages."""
        dst: list[DevicePage] = transfer.dst  # type: ignore[assignment]
        top = transfer.nodes[0].parent
        anchor = req.lease.node if req.lease is not None else self.core.tree.root
        if top is anchor:  # the usual case: the segment starts where the request's L1 hit ends
            return [*req.pages, *dst]
        return [*self.core.path_pages(top, Tier.L1), *dst]  # type: ignore[list-item]

    def _make_room(self, tier: Tier, n: int) -> bool:
        """Evict in ``tier`` until ``n`` pages are free. Under write_back, an L1 victim
        without an L2 copy is first backed up (D2H, waited for) so its prefix survives, and
        exactly that victim is then evicted."""
        core = self.core
        if tier is not Tier.L1 or self.write_policy is not WritePolicy.WRITE_BACK or not core.sizes.l2_pages:
            return core.ensure_free(tier, n)
        if core.l1.num_free >= n:
            return True
        if not core.can_make_room(tier, n):
            return False
        while core.l1.num_free < n:
            victim = core.lru_victim(Tier.L1)
            if victim is None:
                break
            if not victim.has(Tier.L2):
                job = self._start(Direction.D2H, victim, None) if core.can_start(Direction.D2H, victim) else None
                if job is None:
                    self.metrics.backups_skipped += 1
                else:
                    self._landed(job, block=True)
                    self._finish(job)
            if not victim.alive or not core.tree.is_evictable(victim, Tier.L1):
                break  # NOTE: cannot happen (nothing else runs); never loop on it
            core.evict_node(victim, Tier.L1)
        return core.l1.num_free >= n

    def _selective_backup(self, req: Request) -> None:
        """The backup ``admit`` put off for ``req`` (write_through_selective), if any."""
        node, req.selective = req.selective, None
        if node is not None:
            self._backup(node)

    def _backup(self, node: Node) -> None:
        """Write ``node``'s path through to L2 (then L3), or defer it while a transfer above
        it is in flight (the extension of a prefix whose D2H has not landed yet)."""
        if not self.core.sizes.l2_pages or not node.alive:
            return
        if node.has(Tier.L2):
            self._backup_l3(node)
        else:
            self._back_up(node, Direction.D2H)

    def _backup_l3(self, node: Node) -> None:
        if self.storage is None or not node.alive or node.has(Tier.L3):
            return
        if not self.storage.available:
            self.metrics.l3_unavailable += 1
            return
        self._back_up(node, Direction.H2S)

    def _back_up(self, node: Node, direction: Direction) -> None:
        if self.core.can_start(direction, node):
            if self._start(direction, node, None) is None:
                self.metrics.backups_skipped += 1
                self._warn_if_never_fits(node, direction)
        elif any(n.inflight[d] is not None for n in self.core.segment(direction, node) for d in Direction):
            self._deferred[(node.id, direction)] = node  # retried when a transfer ends
        else:
            self.metrics.backups_skipped += 1

    def _warn_if_never_fits(self, node: Node, direction: Direction) -> None:
        """Say once why a backup can never happen: its pages outnumber its whole target tier
        (a prompt longer than L2 is neither in L2 nor in L3, so no restart finds it)."""
        tier = direction.target
        need = sum(len(n.key) for n in self.core.segment(direction, node)) // self.core.page_size
        have = self.core.sizes.l2_pages if tier is Tier.L2 else self.core.sizes.l3_pages
        if need > have and tier not in self._never_fits:
            self._never_fits.add(tier)
            log.warning(
                "hicache: a run of %d pages is larger than all of %s (%d pages): it is not backed up; "
                "give %s at least as many pages as the longest prompt (L1's)",
                need,
                tier.name,
                have,
                tier.name,
            )

    def _forget(self, node: Node) -> None:
        """A shared store lost ``node``'s pages: forget its L3 copy (and below) now, or once
        nothing reads or pins them."""
        if not node.alive or not node.has(Tier.L3):
            self._lost.pop(node.id, None)
            return
        try:
            self.core.lose(node)
        except TransitionRefused:
            self._lost[node.id] = node
            return
        self._lost.pop(node.id, None)
        self.metrics.l3_lost_runs += 1

    def _retry_deferred(self) -> None:
        for node in list(self._lost.values()):
            self._forget(node)
        for key, node in list(self._deferred.items()):
            direction = key[1]
            if not node.alive or node.has(direction.target):
                del self._deferred[key]
            elif self.core.can_start(direction, node):
                del self._deferred[key]
                if self._start(direction, node, None) is None:
                    self.metrics.backups_skipped += 1

    def _account(self, job: _Job, ok: bool) -> None:
        d = job.transfer.direction
        stats = self.metrics.directions[d.name]
        if not ok:
            stats.failed += 1
            return
        stats.count += 1
        try:
            t, nbytes, extents = job.ticket.timings, int(job.ticket.nbytes), int(job.ticket.extents)
            times = [float(x) for x in (t.recurring_s, t.enqueue_s, t.setup_s, t.queue_s, t.service_s, t.total_s)]
        except Exception as exc:  # NOTE: a mover's ticket that cannot say: the copy is fine, its figures lost
            log.warning("hicache: %s ticket's timings could not be read: %r", d.name, exc)
            return
        recurring, enqueue, setup, queue, service, total = times
        stats.bytes += nbytes
        stats.steady_s += recurring
        stats.enqueue_s += enqueue
        stats.setup_s += setup
        stats.queue_s += queue
        stats.service_s += service
        stats.total_s += total
        stats.extents += extents
        self.metrics.observe_transfer(d.name, total)
        self.cost.observe_transfer(d, nbytes, recurring)

    def _verdict(self, job: _Job) -> tuple[bool, str | None]:
        """A landed ticket's ``ok`` and ``error``; a ticket whose ``ok`` or ``error`` raise
        failed its transfer (a mover's exception never leaves the controller)."""
        if job.broken is not None:
            return False, job.broken
        try:
            ok, error = bool(job.ticket.ok), job.ticket.error
        except Exception as exc:
            name = job.transfer.direction.name
            log.warning("hicache: %s ticket's outcome could not be read: %r", name, exc)
            return False, f"the {name} ticket raised {exc!r}"
        return ok, error if error is None or isinstance(error, str) else repr(error)

    def _finish(self, job: _Job) -> PendingRestore | None:
        del self._jobs[job.transfer.id]
        transfer, restore = job.transfer, job.restore
        ok, error = self._verdict(job)
        if ok and self.verifier is not None:
            error = self.verifier.verify(transfer.direction, transfer.src, transfer.dst)
            if error is not None:
                ok = False
                self.metrics.verify_failures += 1
            else:
                self.metrics.verified_pages += len(transfer.dst) if transfer.direction is not Direction.H2S else 0
        self._account(job, ok)
        if not ok:
            self.core.fail(transfer)
            if restore is not None:
                self._end_restore(restore, Outcome.FAILED, error or "transfer failed")
            if job.l3 is not None and job.l3.lost and transfer.direction is Direction.S2H:
                self._forget(transfer.nodes[0])
        else:
            self.core.complete(transfer)  # NOTE: publish first; only then may anyone read it
            if restore is not None:
                self._advance(restore, transfer)
            elif transfer.direction is Direction.D2H:
                self._backup_l3(transfer.nodes[-1])
        self._retry_deferred()
        return restore

    def _advance(self, restore: PendingRestore, transfer: Transfer) -> None:
        """A restore's transfer published: promote (S2H) and go on, or finish (H2D)."""
        req, core = restore.request, self.core
        bottom = transfer.nodes[-1]
        if transfer.direction is Direction.S2H:
            self.metrics.promotions += len(transfer.nodes)  # the L2 pages belong to the tree now
            if req.released:
                self._end_restore(restore, Outcome.CANCELLED, None)
                return
            # Pin the promoted run before making room for the H2D: room-making must not evict it.
            source = core.lock(TierMatch(Tier.L2, restore.plan.tokens, bottom, bottom.version[Tier.L2]))
            if restore.source is not None:
                core.release(restore.source)
            restore.source = source
            if bottom.has(Tier.L1):  # another request brought it to L1 meanwhile: nothing to load
                self._move(req, ReqEvent.PROMOTE, "restore")
                self._publish(restore, bottom, core.path_pages(bottom, Tier.L1))  # type: ignore[arg-type]
                return
            try:
                can = core.can_start(Direction.H2D, bottom)
                started = can and self._start(Direction.H2D, bottom, restore) is not None
            except BaseException:
                # NOTE: an interrupt (or a signal handler's exception) while the mover issued the
                # H2D: that copy failed and no job will end this restore, so it fails here (the
                # request recomputes) and the exception goes on
                self._end_restore(restore, Outcome.FAILED, "interrupted while its H2D was issued")
                raise
            if not started:
                self._end_restore(restore, Outcome.FAILED, "no L1 room for the H2D after promotion")
                return
            self._move(req, ReqEvent.PROMOTE, "restore")
            return
        if req.released:
            self._end_restore(restore, Outcome.CANCELLED, None)
            return
        pages = restore.layer_pages if restore.layer_pages is not None else self._prefix_after(req, transfer)
        self._publish(restore, bottom, pages)

    def _publish(self, restore: PendingRestore, bottom: Node, pages: Sequence[DevicePage]) -> None:
        """The restored prefix ``[0, plan.tokens)`` is in L1 on the path to ``bottom``: move
        the request's pin there and its cached_len up."""
        req, core = restore.request, self.core
        if len(pages) * core.page_size != restore.plan.tokens:
            raise IntegrityError("request-restore-pages", f"request #{req.id}", f"{len(pages)} pages published")
        lease = core.lock(TierMatch(Tier.L1, restore.plan.tokens, bottom, bottom.version[Tier.L1]))
        if req.lease is not None:
            core.release(req.lease)
        gained = restore.plan.tokens - req.cached_len
        req.lease, req.cached_len, req.pages = lease, restore.plan.tokens, list(pages)
        self._end_restore(restore, Outcome.DONE, None)
        self.metrics.observe_restore(time.perf_counter() - restore.started, restore.overlapped_s)
        self.metrics.hit_tokens[restore.plan.tier.name] += gained

    def _end_restore(self, restore: PendingRestore, outcome: Outcome, why: str | None) -> None:
        restore.outcome, restore.error = outcome, why
        restore.transfer = None
        if restore.source is not None:
            self.core.release(restore.source)
            restore.source = None
        req = restore.request
        if outcome is Outcome.FAILED and not req.released:  # NOTE: a released request recomputes nothing
            self.metrics.fallbacks += 1
        if not req.released:
            self._move(req, ReqEvent.PUBLISH if outcome is Outcome.DONE else ReqEvent.FAIL, "restore")

    # -- observability and shutdown ----------------------------------------------------------

    def requests(self) -> list[Request]:
        """The requests admitted and not yet released, oldest first: what a caller that lost
        track of some (an interrupt between ``admit`` and keeping its result) releases."""
        self._enter()
        return list(self._requests.values())

    def status(self) -> ControllerStatus:
        """Capacity/free/protected/evictable per tier, pending work, backends, cost model,
        metrics; typed (``.to_dict()`` for JSON)."""
        self._enter()
        states = {s.value: 0 for s in ReqState if s is not ReqState.RELEASED}
        for r in self._requests.values():
            states[r.state.value] += 1
        return ControllerStatus(
            core=self.core.status(),
            pending_backups=sum(1 for j in self._jobs.values() if j.restore is None),
            pending_restores=sum(1 for j in self._jobs.values() if j.restore is not None),
            requests=len(self._requests),
            request_states=states,
            write_policy=self.write_policy.value,
            transfer=self.device.status(),
            storage=None if self.storage is None else self.storage.status(),
            cost_model=self.cost.state(),
            metrics=self.metrics.to_dict(),
        )

    def prometheus(self) -> str:
        """The metrics in Prometheus text format: counters, latency histograms, and the
        levels (free pages per tier, pending transfers, live requests) as gauges."""
        self._enter()
        tiers = self.core.status().tiers
        levels = Levels(
            {t.tier: t.free for t in tiers},
            {t.tier: t.capacity for t in tiers},
            sum(1 for j in self._jobs.values() if j.restore is None),
            sum(1 for j in self._jobs.values() if j.restore is not None),
            len(self._requests),
        )
        return self.metrics.prometheus({t.name: self.core.evictions[t] for t in Tier}, levels=levels)

    def snapshot(self) -> Snapshot:
        """The core's snapshot plus every live request (what the request invariants see)."""
        views = {r.id: _view(r) for r in self._requests.values()}
        return dataclasses.replace(self.core.snapshot(), requests=views)

    def violations(self) -> list[Violation]:
        """Every broken invariant (page runs and requests); empty when all hold."""
        snap = self.snapshot()
        orphans = [
            Violation(
                "transfer-tracked",
                f"transfer {t.id}",
                f"{t.direction.name} in flight that no job will ever end (its pages stay held)",
                "controller.transfer-untracked",
            )
            for t in self.core.transfers.values()
            if t.id not in self._jobs and t.id not in self._stragglers  # NOTE: a straggler ends when its I/O returns
        ]
        return check_all(snap) + check_requests(snap) + orphans

    def check_integrity(self) -> None:
        """Raise IntegrityError naming the first broken invariant of the page runs or the
        requests (DESIGN.md §4, §4b)."""
        self._enter()
        bad = self.violations()
        if bad:
            v = bad[0]
            raise IntegrityError(v.invariant, v.where, v.detail)

    def drain(self) -> None:
        """Block until every transfer in flight (backups and restores) has finished. A
        transfer failed at its L3 deadline whose I/O has returned since is reaped too (its
        pages free again); one whose I/O still hangs is not waited for (``poll`` reaps it).
        Restores that finish here are reported by the next :meth:`poll`."""
        self._enter()
        while True:
            self._collect()  # NOTE: also the stragglers: their late I/O may have returned
            if not self._jobs:
                return
            for job in list(self._jobs.values()):
                self._landed(job, block=True)

    def flush(self) -> int:
        """Back up to L3, blocking, every run the tree holds only in L1 or L2: what
        ``write_back`` and ``write_through_selective`` leave there (they back up what L1
        evicts, or what is hit often enough), and backups skipped for want of room. L2 copies
        go first (they need no room), then L1 ones through L2, top-down, each waited for.
        Returns the runs now in L3 that were not. :meth:`close` calls it for a store that
        outlives the cache (``dir``, ``mooncake``), so that a restart finds what this
        process computed; a run that cannot be written (no room, the store down) is skipped.
        A write past its deadline ends the flush, and an I/O past its deadline not yet
        returned skips it: the store hangs, and waiting a deadline per run would hold
        :meth:`close` for as many deadlines as there are runs."""
        self._enter()
        self.drain()
        core, storage = self.core, self.storage
        if storage is None or not core.sizes.l2_pages:
            return 0
        if self._stragglers:
            log.warning("hicache: flush skipped: an L3 I/O past its deadline has not returned (the store hangs)")
            return 0
        written = 0
        expired = self.metrics.l3_deadline_failures
        for tier in (Tier.L2, Tier.L1):
            nodes = [n for n in core.tree.iter_nodes() if n.parent is not None]
            for node in sorted(nodes, key=core.tree.depth_tokens):  # NOTE: top-down: parents first
                if not node.alive or node.has(Tier.L3) or not node.has(tier):
                    continue
                if not storage.available:
                    return written
                atomic(self._backup)(node)  # L2: the H2S; L1: the D2H, whose landing issues the H2S
                self.drain()
                written += node.alive and node.has(Tier.L3)
                if self.metrics.l3_deadline_failures > expired:
                    log.warning("hicache: flush stopped: an L3 write passed its deadline (the store hangs)")
                    return written
        return written

    def close(self) -> None:
        """Release every request (with a warning: each should have been released; a restore
        whose copy has not started is withdrawn), withdraw backups not yet started (except H2S
        to a persistent store), drain the rest, then :meth:`flush` to a persistent store (the
        D2H withdrawn included), close storage. Afterwards every call but ``close`` raises
        MisuseError."""
        if self.closed:
            return
        self._enter()
        if self._storage_closing:  # NOTE: a close cut short (Ctrl-C) while storage closed: finish that
            self._close_storage()
            return
        if self._requests:  # NOTE: in a long-running loop, a request never released pins L1 for good
            ids = ", ".join(f"#{r}" for r in list(self._requests)[:5]) + (", ..." if len(self._requests) > 5 else "")
            log.warning(
                "hicache: closing with %d request(s) never released (%s): released now", len(self._requests), ids
            )
        for req in list(self._requests.values()):
            self.release(req)
        keep = self.storage is not None and self.storage.persistent
        for job in list(self._jobs.values()):
            # NOTE: a backup not yet started is worthless once we close, unless it goes to a
            # store that outlives us.
            d = job.transfer.direction
            if (d is Direction.D2H or (d is Direction.H2S and not keep)) and self._cancel(job):
                del self._jobs[job.transfer.id]
                self.core.cancel(job.transfer)
        self.drain()
        if keep:
            self.flush()
        self._storage_closing = True
        self._close_storage()

    def _close_storage(self) -> None:
        """The end of :meth:`close`: storage closed (its waits interruptible; the next close
        goes on from here), then the pages of I/O past its deadline are done with."""
        if self.storage is not None:
            self.storage.close()
        with held():  # NOTE: cut short, a transfer would be cancelled twice by the next close
            for job in self._stragglers.values():  # I/O past its deadline at close: we are done with its pages
                self.core.cancel(job.transfer)
            self._stragglers.clear()
            self._unreported.clear()
            self.closed = True
            if self._signals is not None:
                self._signals()  # NOTE: once: a finalizer runs at most once


_RESTORING = (ReqState.LOADING_L3, ReqState.LOADING_L2)


def _view(r: Request) -> RequestView:
    restore = r.restore if r.restore is not None and not r.restore.finished else None
    transfer = None if restore is None or restore.transfer is None else restore.transfer
    return RequestView(
        id=r.id,
        state=r.state,
        cached_len=r.cached_len,
        pages=tuple(r.pages),
        lease=None if r.lease is None else r.lease.id,
        source=None if restore is None or restore.source is None else restore.source.id,
        transfer=None if transfer is None else transfer.id,
        restore_pages=restore.layer_pages if restore is not None else None,
        restore_tokens=0 if restore is None else restore.plan.tokens,
        private=tuple(r.private),
    )


def parse_write_policy(value: object) -> WritePolicy:
    try:
        return WritePolicy(value)  # type: ignore[arg-type]
    except ValueError:
        raise ConfigError(f"write_policy must be one of {[p.value for p in WritePolicy]}, got {value!r}") from None


def _one_d_array(value: object) -> bool:
    """A 1-D tensor or array (not a sequence in Python's sense, yet a list of ids to a caller)."""
    return not isinstance(value, Sequence) and hasattr(value, "tolist") and getattr(value, "ndim", None) == 1


def check_selective_hits(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"selective_hits must be an int >= 1, got {value!r}")


# A timing a model may learn from: a day. Past it nothing is a prefill or a decode batch, and
# timings near the float range made the cost model's fits overflow to NaN (one sample spoiled
# every plan until its window had turned over).
MAX_SECONDS = 86_400.0
# A prefill's token count the model may learn from: float's exact integers. Past them the
# fit's squares overflow.
MAX_OBSERVED_TOKENS = 2**53


def _check_seconds(call: str, seconds: object) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_SECONDS:
        raise MisuseError(f"{call}: seconds must be a number in [0, {MAX_SECONDS:.0f}], got {seconds!r:.60}")
