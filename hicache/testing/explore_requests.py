"""Binds :func:`hicache.spec.explorer.explore` to the real :class:`Controller` (requests x runs).

The controller runs over the core and tag movers (:mod:`hicache.testing.tag_movers`) whose
copies wait until the explorer finishes them. Operations, each only when enabled: per
sequence i, ``admit:i`` (no live request for i), then by the request's state ``restore:i``
(``start_restore``, layered), ``allocate:i`` (exactly the pages its uncached part needs; one
decode page once running; not while they could never fit beside those it holds: allocate
refuses those), ``insert:i`` (write what a prefill computes into its private
pages, then insert), ``release:i``; per queued copy k, ``complete:k`` / ``fail:k`` (then
``poll``), ``begin:k`` (a restore's copy starts: it can no longer be withdrawn) and, with L3
faults on, ``lose:k`` (an L3 read finds its pages gone), ``expire:k`` / ``settle:k`` (an L3
copy past its deadline, then its I/O returning); ``evict:T`` (memory pressure in tier T);
``close`` (the controller closes: a final state).

Every state is checked for the page-run and request invariants (``Controller.violations``)
and for content: every published page and every live request's prefix page holds its own
token prefix's tag. ``python -m hicache.testing.explore_requests [--config NAME] [--depth N]``
explores the :data:`CONFIGS` with progress per level.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import partial
from typing import Self, cast

from hicache.core.cache import CacheCore
from hicache.core.controller import Controller, Request, WritePolicy
from hicache.core.cost import CostModel, CostPriors
from hicache.core.geometry import DevicePage, TierSizes
from hicache.core.node import Lease, Node
from hicache.errors import HiCacheError
from hicache.spec.explorer import Coverage, ExploreReport, check_run, explore, explore_main, transition_name
from hicache.spec.invariants import Violation
from hicache.spec.model import TABLE, Direction, Tier
from hicache.spec.request import REQUEST_TABLE, ReqEvent, ReqState, request_step
from hicache.testing.fake_backend import POISON, page_tag
from hicache.testing.tag_movers import TagDevice, TagFabric, TagStorage, TagTicket

PUBLISHED = "ordering.published"
""":meth:`RequestSystem.check`'s report of a published page holding another prefix's tag."""
PREFIX = "ordering.request-prefix"
""":meth:`RequestSystem.check`'s report of a live request's prefix page holding a wrong tag."""
RAISED = "controller.raised"
""":meth:`RequestSystem.check`'s report of an operation on which the controller raised."""

UNIVERSE: dict[str, frozenset[Hashable]] = {"run": frozenset(TABLE), "request": frozenset(REQUEST_TABLE)}
"""Per model, every transition there is."""

_RESTORING = (ReqState.LOADING_L2, ReqState.LOADING_L3)


@dataclass(frozen=True)
class Config:
    """One small scope: page size, capacities, write policy, the sequences requests use,
    the depth the suite explores to, whether L3 copies may be lost or expire, ``chunk``:
    at most this many pages per ``allocate`` (a chunked prefill; None: all at once), and
    ``setup``: operations applied before exploring (a warm start deeper in the space)."""

    page_size: int
    sizes: TierSizes
    policy: WritePolicy
    sequences: tuple[tuple[int, ...], ...]
    depth: int
    l3_faults: bool = False
    chunk: int | None = None
    setup: tuple[str, ...] = ()
    expected_request: frozenset[tuple[ReqState, ReqEvent]] = field(default=frozenset(REQUEST_TABLE))

    def system(self) -> RequestSystem:
        system = RequestSystem(self)
        for action in self.setup:
            if action not in system.actions():
                raise ValueError(f"setup action {action!r} is not enabled (enabled: {system.actions()})")
            system.apply(action)
        system.forget_history()
        return system


class RequestSystem:
    """The real controller over tag movers, as an explorable system."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        core = CacheCore(cfg.page_size, cfg.sizes, tracing=True)
        self.fabric = TagFabric(cfg.sizes.capacities)
        self.controller = Controller(
            core,
            TagDevice(self.fabric),
            TagStorage(self.fabric) if cfg.sizes.l3_pages else None,
            CostModel(1, CostPriors(), "always"),
            write_policy=cfg.policy,
            selective_hits=1,
        )
        self.sequences = [tuple(s) for s in cfg.sequences]
        self.live: dict[int, Request] = {}  # sequence index -> its live request
        self.decode: dict[int, DevicePage] = {}  # sequence index -> its decode page
        self._blob: bytes | None = None
        self._problems: list[Violation] = []  # found by the last operation itself

    @property
    def core(self) -> CacheCore:
        return self.controller.core

    # -- Explorable ------------------------------------------------------------------------

    def actions(self) -> list[str]:
        if self.controller.closed:
            return []
        out: list[str] = ["close"]
        for i in range(len(self.sequences)):
            req = self.live.get(i)
            if req is None:
                out.append(f"admit:{i}")
                continue
            if req.state is ReqState.ADMITTED:
                out.append(f"restore:{i}")
            missing = self._missing(i)
            fits = missing + len(req.pages) + len(req.private) <= self.core.l1.capacity
            if missing and fits and request_step(req.state, ReqEvent.ALLOCATE) is not None:
                out.append(f"allocate:{i}")
            if not missing and req.state in (ReqState.ADMITTED, ReqState.READY, ReqState.PREFILLING):
                out.append(f"insert:{i}")
            out.append(f"release:{i}")
        restoring = {r.restore.transfer.id for r in self.live.values() if r.restore and r.restore.transfer}
        for k, ticket in enumerate(self.fabric.queue):
            if ticket.expired:
                out.append(f"settle:{k}")
                continue
            out += [f"complete:{k}", f"fail:{k}"]
            if not ticket.begun and self._transfer_id(ticket) in restoring:
                out.append(f"begin:{k}")
            if self.cfg.l3_faults and ticket.direction in (Direction.S2H, Direction.H2S):
                out.append(f"expire:{k}")
                if ticket.direction is Direction.S2H:
                    out.append(f"lose:{k}")
        for t in Tier:
            if self.core.tree.evictable[t]:
                out.append(f"evict:{t.name}")
        return sorted(out)

    def _missing(self, i: int) -> int:
        """Private pages request i still needs: for its uncached part ``[base, len)``
        (``base``: the restore's length while an H2D is in flight), or one decode page once
        it runs."""
        req = self.live[i]
        if req.state is ReqState.RUNNING:
            return 0 if i in self.decode else 1
        base = req.cached_len
        if req.restore is not None and not req.restore.finished:
            base = req.restore.plan.tokens
        ps = self.core.page_size
        missing = max(0, -(-(len(self.sequences[i]) - base) // ps) - len(req.private))
        return missing if self.cfg.chunk is None else min(missing, self.cfg.chunk)

    def _transfer_id(self, ticket: TagTicket) -> int | None:
        for x in self.core.transfers.values():
            if x.direction is ticket.direction and tuple(x.dst) == ticket.dst:
                return x.id
        return None

    def apply(self, action: str) -> None:
        self._blob = None
        self._problems = []
        try:
            self._apply(action)
        except HiCacheError as exc:
            self._problems.append(Violation("controller", action, f"{type(exc).__name__}: {exc}", RAISED))
        # NOTE: the trace is history, not state; kept, it would be copied into every clone.
        self.core.tree.trace.clear()

    def _apply(self, action: str) -> None:
        c = self.controller
        if action == "close":
            c.close()
            self.live.clear()
            self.decode.clear()
            return
        verb, arg = action.split(":")
        if verb == "evict":
            self.core.evict(Tier[arg], 1)
            return
        if verb in ("complete", "fail", "begin", "lose", "expire", "settle"):
            ticket = self.fabric.queue[int(arg)]
            if verb == "begin":
                ticket.begun = True
                return
            if verb == "expire":
                self.fabric.expire(ticket)
            elif verb == "settle":
                self.fabric.settle(ticket)
            else:
                self.fabric.finish(ticket, ok=verb == "complete", lost=verb == "lose")
            c.poll()
            return
        i = int(arg)
        seq = self.sequences[i]
        if verb == "admit":
            self.live[i] = c.admit(seq)
            return
        req = self.live[i]
        if verb == "restore":
            c.start_restore(req, layer_events=())
        elif verb == "allocate":
            pages = c.allocate(req, self._missing(i))
            for p in pages or ():  # a fresh page holds garbage until written
                self.fabric.content[Tier.L1][p] = POISON
            if pages and req.state is ReqState.RUNNING:
                self.decode[i] = pages[0]
        elif verb == "insert":
            ps = self.core.page_size
            first = req.cached_len // ps
            for j, p in enumerate(req.private):  # what the prefill computes: its page of the prompt
                self.fabric.content[Tier.L1][p] = page_tag(seq[: min(len(seq), (first + j + 1) * ps)])
            c.insert(req, list(req.private))
        elif verb == "release":
            c.release(self.live.pop(i))
            self.decode.pop(i, None)
        else:
            raise ValueError(f"unknown action {action!r}")

    def clone(self) -> Self:
        # NOTE: the bytes are kept until the next apply: expanding a state pickles it once.
        # The metrics and the cost model are shared, not copied: they count and learn, but
        # decide nothing here (the policy is "always"), and copying them doubled the cost.
        shared = self._shared()
        if self._blob is None:
            buf = io.BytesIO()
            _SharingPickler(buf, shared).dump(self)
            self._blob = buf.getvalue()
        child: Self = _SharingUnpickler(io.BytesIO(self._blob), shared).load()
        return child

    def _shared(self) -> list[object]:
        return [self.controller.metrics, self.controller.cost]

    def forget_history(self) -> None:
        """Drop the coverage taken so far (a warm start's setup is not exploration)."""
        self.core.tree.coverage.clear()
        self.controller.request_coverage.clear()
        self._blob = None

    def key(self) -> Hashable:
        """Everything that can change what happens next, canonically.

        As :meth:`hicache.testing.explore_core.CoreSystem.key` (node ids -> token paths,
        stamps -> ranks per tier, transfers -> queue positions, free lists, contents of
        pages in use), plus each live request (sequence, state, cached_len, pages, private
        pages, decode page, lease, its admission match while admitted, its restore's plan,
        source lease, transfer and layered pages, the backup it put off), each job's owner,
        each queued copy's progress, and the controller's deferred backups and lost runs.
        Left out: ids, clocks, versions (but whether a held match is still fresh), metrics,
        coverage.
        """
        c, core = self.controller, self.core
        tree = core.tree
        path = {n.id: tree.tokens_of(n) for n in tree.nodes.values()}
        pos: dict[int, int] = {}
        for k, ticket in enumerate(self.fabric.queue):
            tid = self._transfer_id(ticket)
            if tid is not None:
                pos[tid] = k

        def lease(x: Lease | None) -> tuple[object, ...] | None:
            return None if x is None else (x.tier, path.get(x.node.id), x.length, x.released)

        ranks: list[dict[int, int]] = []
        for t in Tier:
            stamps = sorted({n.stamp[t] for n in tree.nodes.values() if n.pages[t] is not None})
            ranks.append({s: r for r, s in enumerate(stamps)})
        nodes = tuple(
            sorted(
                (
                    path[n.id],
                    len(n.key),
                    tuple(None if p is None else tuple(p) for p in n.pages),
                    tuple(n.refs),
                    tuple(n.tier_children),
                    tuple(None if n.pages[t] is None else ranks[t][n.stamp[t]] for t in Tier),
                    tuple(None if x is None else pos.get(x.id, -1) for x in n.inflight),
                    tuple(None if p is None else tuple(p) for p in n.pending),
                    min(n.hits, c.selective_hits),
                )
                for n in tree.nodes.values()
            )
        )
        index = tuple(
            frozenset(
                path.get(nid)
                for nid, stamp in tree.index_entries(t)
                if (n := tree.nodes.get(nid)) is not None and n.stamp[t] == stamp and tree.is_evictable(n, t)
            )
            for t in Tier
        )
        allocators = (core.l1, core.l2, core.l3)
        free = tuple(tuple(a.runs()) for a in allocators)
        content = tuple(
            tuple(tag for p, tag in enumerate(self.fabric.content[t]) if not allocators[t].is_free(p)) for t in Tier
        )

        def fresh(node: Node, tier: Tier, version: int) -> bool:
            return node is tree.root or (node.alive and node.has(tier) and node.version[tier] == version)

        requests = []
        for i, r in sorted(self.live.items()):
            match = None
            if r.state is ReqState.ADMITTED:
                match = tuple(
                    (m.length, path.get(m.node.id), fresh(m.node, m.tier, m.version))
                    for m in (r.match.l1, r.match.l2, r.match.l3)
                )
            restore = None
            x = r.restore
            if x is not None and not x.finished:
                restore = (
                    x.plan.tier,
                    x.plan.tokens,
                    lease(x.source),
                    None if x.transfer is None else pos.get(x.transfer.id, -1),
                    None if x.pages is None else tuple(x.pages),
                )
            requests.append(
                (
                    i,
                    r.state,
                    r.cached_len,
                    tuple(r.pages),
                    tuple(r.private),
                    self.decode.get(i),
                    lease(r.lease),
                    match,
                    restore,
                    None if r.selective is None else (path.get(r.selective.id), r.selective.alive),
                )
            )
        owner = {id(r): i for i, r in self.live.items()}
        jobs = tuple(
            sorted(
                (
                    pos.get(tid, -1),
                    None if j.restore is None else owner.get(id(j.restore.request), -1),
                )
                for tid, j in {**c._jobs, **c._stragglers}.items()
            )
        )
        queue = tuple(
            (
                t.order,
                t.begun,
                t.expired,
            )
            for t in self.fabric.queue
        )
        transfers = tuple(
            sorted(
                (
                    pos.get(x.id, -1),
                    x.direction,
                    tuple(path.get(n.id) for n in x.nodes),
                    lease(x.src_lease),
                    lease(x.dst_lease),
                )
                for x in core.transfers.values()
            )
        )
        leases = tuple(sorted((lease(x) for x in tree.leases.values()), key=repr))
        counters = (tuple(tree.protected), tuple(tree.evictable))
        deferred = tuple((path.get(n.id), d) for (_, d), n in c._deferred.items())
        lost = tuple(path.get(n.id) for n in c._lost.values())
        return (
            nodes,
            index,
            free,
            tuple(sorted(core.private)),
            content,
            tuple(requests),
            jobs,
            queue,
            transfers,
            leases,
            counters,
            deferred,
            lost,
            c.closed,
        )

    def check(self) -> list[Violation]:
        """The page-run and request invariants, what the last operation raised, and content:
        every published page, and every live request's prefix page, holds the tag of its
        own token prefix (nothing published or handed over before its copy landed)."""
        core, ps = self.core, self.core.page_size
        out = self.controller.violations() + self._problems
        for n in core.tree.nodes.values():
            if n.parent is None:
                continue
            tokens = core.tree.tokens_of(n)
            first = (len(tokens) - len(n.key)) // ps
            want = [page_tag(tokens[: (first + j + 1) * ps]) for j in range(len(n.key) // ps)]
            for t in Tier:
                pages = n.pages[t]
                if pages is not None and self.fabric.tags(t, pages) != want:
                    out.append(Violation("ordering", repr(n), f"its {t.name} pages hold other content", PUBLISHED))
        for i, r in sorted(self.live.items()):
            seq = self.sequences[i]
            want = [page_tag(seq[: (j + 1) * ps]) for j in range(r.cached_len // ps)]
            if self.fabric.tags(Tier.L1, self.controller.prefix_pages(r)) != want:
                out.append(Violation("ordering", f"request for {seq}", "its prefix pages hold other content", PREFIX))
        return out

    def coverage(self) -> Coverage:
        return {"run": self.core.tree.coverage.keys(), "request": self.controller.request_coverage.keys()}


_PS1 = ((1, 2), (1, 3))
_PS2 = ((1, 1, 2, 2, 5), (1, 1, 3, 3))

_WT = WritePolicy.WRITE_THROUGH
_SEL = WritePolicy.SELECTIVE
_WB = WritePolicy.WRITE_BACK
_S = TierSizes(3, 3, 3)
# Warm starts: sequence 0 backed up to every tier by each policy's own path, then released.
_WARM_WT = ("admit:0", "allocate:0", "insert:0", "complete:0", "complete:0", "release:0")
_WARM_SEL = ("admit:0", "allocate:0", "insert:0", "release:0", "admit:0", "complete:0", "complete:0", "release:0")
_WARM_WB = (
    *("admit:0", "allocate:0", "insert:0", "release:0"),
    *("admit:1", "allocate:1", "insert:1", "allocate:1", "complete:0", "release:1"),
)
CONFIGS: dict[str, Config] = {
    "wt-ps1": Config(1, _S, _WT, _PS1, 10, chunk=1),
    "sel-ps1": Config(1, _S, _SEL, _PS1, 10),
    "wb-ps1": Config(1, _S, _WB, _PS1, 12),
    "wt-warm": Config(1, _S, _WT, _PS1, 8, setup=_WARM_WT, l3_faults=True),
    "sel-warm": Config(1, _S, _SEL, _PS1, 8, setup=_WARM_SEL),
    "wb-warm": Config(1, _S, _WB, _PS1, 8, setup=_WARM_WB),
    "wt-ps2": Config(2, _S, _WT, _PS2, 10),
    "wb-ps2": Config(2, _S, _WB, _PS2, 10),
}


class _SharingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, shared: list[object]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.shared = {id(x): k for k, x in enumerate(shared)}

    def persistent_id(self, obj: object) -> int | None:
        return self.shared.get(id(obj))


class _SharingUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, shared: list[object]) -> None:
        super().__init__(file)
        self.shared = shared

    def persistent_load(self, pid: object) -> object:
        return self.shared[cast(int, pid)]


def run(name: str, depth: int | None = None, *, verbose: bool = False) -> ExploreReport:
    """Explore configuration ``name`` to ``depth`` (its own depth if None)."""
    check_run(name, depth, CONFIGS)
    cfg = CONFIGS[name]
    depth = cfg.depth if depth is None else depth
    if verbose:
        print(
            f"[{name}] page size {cfg.page_size}, capacities {cfg.sizes.capacities}, {cfg.policy.value}, "
            f"sequences {list(cfg.sequences)}, setup {list(cfg.setup)}, depth {depth}",
            flush=True,
        )
    report = explore(
        cfg.system(),
        depth,
        universe=UNIVERSE,
        progress=(lambda d, s, e: print(f"  depth {d}: {s} states, {e} edges", flush=True)) if verbose else None,
    )
    if verbose:
        print(f"[{name}] {report.summary()}", flush=True)
        for model in UNIVERSE:
            missing = sorted(report.missing(model), key=repr)
            if missing:
                print(f"  {model} never reached: " + ", ".join(transition_name(t) for t in missing))
        for trace, v in report.violations:
            print(f"  VIOLATION {v.code or v.invariant} at {v.where}: {v.detail}\n  after {trace}")
    return report


def main(argv: list[str] | None = None) -> int:
    description = "Exhaustively explore requests x page runs at small scope."
    return explore_main(
        argv, description, CONFIGS, partial(run, verbose=True), "python -m hicache.testing.explore_requests"
    )


if __name__ == "__main__":
    raise SystemExit(main())
