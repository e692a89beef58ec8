"""Binds :func:`hicache.spec.explorer.explore` to the real core and a fake backend.

Operations (each enabled only when it makes sense): ``prefill:i`` (a request for sequence i
takes private L1 pages beyond its L1 hit and writes their content), ``insert:i`` /
``abort:i`` (end it), ``start:D:i`` (a transfer in direction D ending at sequence i's
deepest source copy), ``complete:k`` / ``fail:k`` / ``cancel:k`` (the k-th in-flight
transfer), ``evict:T`` (one LRU leaf of tier T), ``discover:i`` (a shared store is found to
hold all of sequence i) and ``lose:i`` (a read found the top run of i's L3 path that may lose
its copy gone from the store). Every state is checked for the structural
invariants, page content (ordering) and, after an eviction, LRU order.

``python -m hicache.testing.explore_core [--config NAME] [--depth N]`` explores the
:data:`CONFIGS` with progress per level and names any transition never reached.
"""

from __future__ import annotations

import pickle
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Self

from hicache.core.cache import CacheCore
from hicache.core.geometry import DevicePage, TierSizes
from hicache.core.node import Lease, Node, Transfer
from hicache.spec.explorer import Coverage, ExploreReport, check_run, explore, explore_main, transition_name
from hicache.spec.invariants import Violation, check_all
from hicache.spec.model import TABLE, Direction, RunState, Tier, may_evict
from hicache.spec.snapshot import Snapshot
from hicache.testing.fake_backend import FakeBackend, page_tag

ORDERING = "ordering.content"
""":meth:`CoreSystem.check`'s report of a matched page holding another prefix's content."""
LRU = "eviction.not-lru"
""":meth:`CoreSystem.check`'s report of an eviction that did not take the LRU leaf copy."""

UNIVERSE: dict[str, frozenset[Hashable]] = {"run": frozenset(TABLE)}
"""Per model, every transition the explorer should reach (the request model joins here)."""


@dataclass
class _Request:
    lease: Lease | None
    shared: list[DevicePage]
    private: list[DevicePage]


class CoreSystem:
    """The real :class:`CacheCore` plus a fake backend, as an explorable system."""

    def __init__(self, page_size: int, sizes: TierSizes, sequences: Sequence[tuple[int, ...]]) -> None:
        self.core = CacheCore(page_size, sizes, tracing=True)
        self.fake = FakeBackend(self.core)
        self.sequences = [tuple(s) for s in sequences]
        self.requests: dict[int, _Request] = {}
        self.flying: list[Transfer] = []  # in a canonical order (sorted at each start)
        self._blob: bytes | None = None
        self._problems: list[Violation] = []  # found by the last operation itself

    # -- Explorable ------------------------------------------------------------------------

    def actions(self) -> list[str]:
        core = self.core
        out: list[str] = []
        for i, seq in enumerate(self.sequences):
            if i in self.requests:
                out += [f"insert:{i}", f"abort:{i}"]
            else:
                need = len(seq) // core.page_size - core.match(seq).l1.length // core.page_size
                if need and core.l1.can_allocate(need):
                    out.append(f"prefill:{i}")
            hit = core.match(seq)
            for d in Direction:
                m = hit[d.source]
                if m.length and core.can_start(d, m.node):
                    out.append(f"start:{d.name}:{i}")
        for k in range(len(self.flying)):
            out += [f"complete:{k}", f"fail:{k}", f"cancel:{k}"]
        for t in Tier:
            if core.tree.evictable[t]:
                out.append(f"evict:{t.name}")
        if core.sizes.l3_pages:
            for i, seq in enumerate(self.sequences):
                if core.match(seq).l3.length < len(seq) - len(seq) % core.page_size:
                    out.append(f"discover:{i}")
                if self._losable(seq) is not None:
                    out.append(f"lose:{i}")
        return sorted(set(out))

    def _losable(self, seq: tuple[int, ...]) -> Node | None:
        """The topmost run of ``seq``'s L3 path that may lose its copy, if any."""
        hit = self.core.match(seq).l3
        if not hit.length:
            return None
        return next((n for n in self.core.tree.path(hit.node) if self.core.can_lose(n)), None)

    def apply(self, action: str) -> None:
        self._blob = None
        self._problems = []
        self._apply(action)
        # NOTE: the trace is history, not state; kept, it would be copied into every clone.
        self.core.tree.trace.clear()

    def _apply(self, action: str) -> None:
        core = self.core
        verb, *args = action.split(":")
        if verb == "prefill":
            i = int(args[0])
            seq = self.sequences[i]
            hit = core.match(seq)
            lease = core.lock(hit.l1) if hit.l1.length else None
            pages = core.allocate_l1(len(seq) // core.page_size - hit.l1.length // core.page_size)
            assert pages is not None
            shared = core.pages_l1(hit.l1)
            self.fake.prefill(seq, len(shared), pages)
            self.requests[i] = _Request(lease, shared, pages)
        elif verb in ("insert", "abort"):
            i = int(args[0])
            req = self.requests.pop(i)
            if verb == "insert":
                result = core.insert(self.sequences[i], [*req.shared, *req.private])
                core.free_private(result.rejected)
            else:
                core.free_private(req.private)
            if req.lease is not None:
                core.release(req.lease)
        elif verb == "start":
            d = Direction[args[0]]
            node: Node = core.match(self.sequences[int(args[1])])[d.source].node
            transfer = core.start(d, node)
            if transfer is not None:  # None: no free target pages (nothing changed)
                self.fake.submit(transfer)
                self.flying.append(transfer)
                # Two transfers started in either order are the same state.
                self.flying.sort(key=lambda x: (x.direction, x.src, x.dst))
        elif verb in ("complete", "fail", "cancel"):
            transfer = self.flying.pop(int(args[0]))
            if verb == "cancel":
                self.fake.cancel(transfer)
            else:
                self.fake.finish(transfer, ok=verb == "complete")
        elif verb == "discover":
            seq = self.sequences[int(args[0])]
            ps = core.page_size
            m = core.discover(seq, len(seq) // ps)
            for k in range(ps, m.length + 1, ps):  # the store's pages hold their prefix's content
                self.fake.content[Tier.L3][core.pages(core.match(seq[:k]).l3)[-1]] = page_tag(seq[:k])
        elif verb == "lose":
            lost = self._losable(self.sequences[int(args[0])])
            assert lost is not None
            core.lose(lost)
        elif verb == "evict":
            tier = Tier[args[0]]
            lru = self._lru_leaves(tier)
            had = [n for n in core.tree.nodes.values() if n.pages[tier] is not None]
            core.evict(tier, 1)
            for n in had:
                if n.pages[tier] is None and n not in lru:
                    self._problems.append(Violation("eviction", repr(n), f"evicted in {tier.name}, not LRU", LRU))
        else:
            raise ValueError(f"unknown action {action!r}")

    def _lru_leaves(self, tier: Tier) -> list[Node]:
        """The evictable leaf copies of ``tier`` with the oldest stamp, recomputed from the
        nodes (not the core's index or counters)."""
        leaves = [
            n
            for n in self.core.tree.nodes.values()
            if n.parent is not None
            and n.pages[tier] is not None
            and not n.refs[tier]
            and all(c.pages[tier] is None for c in n.children.values())
            and may_evict(
                tier,
                frozenset(t for t in Tier if n.pages[t] is not None),
                frozenset(d for d in Direction if n.inflight[d] is not None),
            )
        ]
        oldest = min((n.stamp[tier] for n in leaves), default=None)
        return [n for n in leaves if n.stamp[tier] == oldest]

    def clone(self) -> Self:
        # NOTE: pickle round trips are about twice as fast as deepcopy here, and the bytes
        # are kept until the next apply, so expanding a state serialises it only once.
        if self._blob is None:
            self._blob = pickle.dumps(self, pickle.HIGHEST_PROTOCOL)
        child: Self = pickle.loads(self._blob)
        return child

    def key(self) -> Hashable:
        """Everything that can change what happens next, canonically.

        Left out on purpose: ids, the LRU clock, copy versions, eviction totals, the trace
        and coverage counters (history: only ever compared with themselves), stale
        eviction-index entries and stamps of absent copies (both ignored until replaced),
        and the content of free pages (written before any read).
        Node ids become token paths, transfers their position in the canonical order,
        stamps their rank per tier.
        """
        core = self.core
        tree = core.tree
        path = {n.id: tree.tokens_of(n) for n in tree.nodes.values()}
        pos = {x.id: k for k, x in enumerate(self.flying)}

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
                )
                for n in tree.nodes.values()
            )
        )
        # NOTE: only entries eviction can take: one for a copy that is not evictable now is
        # skipped (and dropped) when met, and pushed again when the copy becomes evictable.
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
            tuple(tag for p, tag in enumerate(self.fake.content[t]) if not allocators[t].is_free(p)) for t in Tier
        )
        reqs = tuple(sorted((i, tuple(r.shared), tuple(r.private), lease(r.lease)) for i, r in self.requests.items()))
        flying = tuple(
            (
                x.direction,
                tuple(path.get(n.id) for n in x.nodes),
                tuple(x.src),
                tuple(x.dst),
                lease(x.src_lease),
                lease(x.dst_lease),
            )
            for x in self.flying
        )
        leases = tuple(sorted((lease(x) for x in tree.leases.values()), key=repr))
        counters = (tuple(tree.protected), tuple(tree.evictable))
        return (nodes, index, free, tuple(sorted(core.private)), content, reqs, flying, leases, counters)

    def snapshot(self) -> Snapshot:
        return self.core.snapshot()

    def check(self) -> list[Violation]:
        """The structural invariants; that the last eviction took an LRU leaf; invariant 3
        (ordering) via content: every page a match returns holds the content of its own
        token prefix (nothing visible before publish)."""
        core = self.core
        out = check_all(self.snapshot()) + self._problems
        for seq in self.sequences:
            hit = core.match(seq)
            for t in Tier:
                pages = core.pages(hit[t])
                want = [page_tag(seq[: (j + 1) * core.page_size]) for j in range(len(pages))]
                if self.fake.tags(t, pages) != want:
                    out.append(
                        Violation("ordering", f"{t.name} match of {seq}", "page content is not its prefix's", ORDERING)
                    )
        return out

    def coverage(self) -> Coverage:
        return {"run": self.core.tree.coverage.keys()}


@dataclass(frozen=True)
class Config:
    """One small scope: page size, tier capacities, the sequences requests use, and the
    depth the test suite explores it to (``exhaustive``: that depth exhausts the scope)."""

    page_size: int
    sizes: TierSizes
    sequences: tuple[tuple[int, ...], ...]
    depth: int
    exhaustive: bool = False

    def system(self) -> CoreSystem:
        return CoreSystem(self.page_size, self.sizes, self.sequences)

    def expected(self) -> dict[str, frozenset[Hashable]]:
        """Per model, the transitions this scope must reach. Page runs: all of ``TABLE``
        but those whose states hold, or move pages into or out of, a tier of capacity 0."""
        absent = {t for t in Tier if self.sizes.capacities[t] == 0}

        def touched(s: RunState) -> set[Tier]:
            return set(s.resident) | {t for d in s.in_flight for t in (d.source, d.target)}

        run = frozenset((s, e) for (s, e), after in TABLE.items() if not absent & (touched(s) | touched(after)))
        return {"run": run}


# Depths: ps1 and ps2 each reach all of TABLE from depth 7 (discovery and loss widen every
# level: ps1 at depth 12 is ~110k states); the suite's depth 8 costs ~30 s of CPU in all.
CONFIGS: dict[str, Config] = {
    "ps1": Config(1, TierSizes(3, 3, 3), ((1, 2), (1, 3)), 8),
    "ps2": Config(2, TierSizes(3, 2, 3), ((1, 1, 2, 2), (1, 1, 3, 3)), 8),
    # No L3 (capacity 0) and three-page prompts (multi-node segments), explored to the end.
    "ps1-no-l3": Config(1, TierSizes(4, 3, 0), ((1, 2, 3), (1, 2, 4)), 24, exhaustive=True),
}


def run(name: str, depth: int | None = None, *, verbose: bool = False) -> ExploreReport:
    """Explore configuration ``name`` to ``depth`` (its own depth if None)."""
    check_run(name, depth, CONFIGS)
    cfg = CONFIGS[name]
    depth = cfg.depth if depth is None else depth
    if verbose:
        print(
            f"[{name}] page size {cfg.page_size}, capacities {cfg.sizes.capacities}, "
            f"sequences {list(cfg.sequences)}, depth {depth}",
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
        for model, want in cfg.expected().items():
            missing = sorted(want - report.covered.get(model, set()), key=repr)
            print(f"  {model}: {len(want) - len(missing)}/{len(want)} of the transitions this scope allows")
            if missing:
                print("  never reached: " + ", ".join(transition_name(t) for t in missing))
        for trace, v in report.violations:
            print(f"  VIOLATION {v.code or v.invariant} at {v.where}: {v.detail}\n  after {trace}")
    return report


def main(argv: list[str] | None = None) -> int:
    description = "Exhaustively explore the core at small scope."
    return explore_main(
        argv, description, CONFIGS, partial(run, verbose=True), "python -m hicache.testing.explore_core"
    )


if __name__ == "__main__":
    raise SystemExit(main())
