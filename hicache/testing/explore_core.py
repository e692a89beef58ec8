"""Binds :func:`hicache.spec.explorer.explore` to the real core and a fake backend.

Operations (each enabled only when it makes sense): ``prefill:i`` (a request for sequence i
takes private L1 pages beyond its L1 hit and writes their content), ``insert:i`` /
``abort:i`` (end it), ``start:D:i`` (a transfer in direction D ending at sequence i's
deepest source copy), ``complete:k`` / ``fail:k`` / ``cancel:k`` (the k-th in-flight
transfer), ``evict:T`` (one LRU leaf of tier T).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Self

from hicache.core.cache import CacheCore
from hicache.core.geometry import DevicePage, TierSizes
from hicache.core.node import Lease, Node, Transfer
from hicache.spec.explorer import explore
from hicache.spec.invariants import Violation
from hicache.spec.model import Direction, Event, RunState, Tier
from hicache.spec.snapshot import Snapshot
from hicache.testing.fake_backend import FakeBackend, page_tag


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
        self.flying: list[Transfer] = []

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
        return sorted(set(out))

    def apply(self, action: str) -> None:
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
        elif verb in ("complete", "fail", "cancel"):
            transfer = self.flying.pop(int(args[0]))
            if verb == "cancel":
                self.fake.cancel(transfer)
            else:
                self.fake.finish(transfer, ok=verb == "complete")
        elif verb == "evict":
            core.evict(Tier[args[0]], 1)
        else:
            raise ValueError(f"unknown action {action!r}")

    def clone(self) -> Self:
        return copy.deepcopy(self)

    def key(self) -> Hashable:
        core = self.core
        nodes = []
        stack: list[tuple[Node, tuple[int, ...]]] = [(core.tree.root, ())]
        while stack:
            n, above = stack.pop()
            full = above + n.key
            nodes.append(
                (
                    full,
                    tuple(None if p is None else tuple(p) for p in n.pages),
                    tuple(n.refs),
                    tuple(None if x is None else self.flying.index(x) for x in n.inflight),
                )
            )
            stack.extend((c, full) for c in n.children.values())
        reqs = tuple(sorted((i, tuple(r.private), r.lease is not None) for i, r in self.requests.items()))
        flying = tuple((x.direction, tuple(x.src), tuple(x.dst)) for x in self.flying)
        # LRU order matters for what evict picks next: rank stamps instead of raw clocks.
        stamps = sorted({s for n in core.tree.nodes.values() for s in n.stamp})
        rank = {s: i for i, s in enumerate(stamps)}
        order = tuple(
            sorted((tuple(rank[s] for s in n.stamp), core.tree.tokens_of(n)) for n in core.tree.nodes.values())
        )
        return (tuple(sorted(nodes, key=repr)), reqs, flying, order)

    def snapshot(self) -> Snapshot:
        return self.core.snapshot()

    def check(self) -> list[Violation]:
        """Invariant 3 (ordering) via content: every published page and every page a match
        returns holds the content of its own token prefix (nothing visible before publish)."""
        core = self.core
        out: list[Violation] = []
        for seq in self.sequences:
            hit = core.match(seq)
            for t in Tier:
                pages = core.pages(hit[t])
                want = [page_tag(seq[: (j + 1) * core.page_size]) for j in range(len(pages))]
                if self.fake.tags(t, pages) != want:
                    out.append(Violation("ordering", f"{t.name} match of {seq}", "page content is not its prefix's"))
        return out

    def coverage(self) -> set[tuple[RunState, Event]]:
        return set(self.core.tree.coverage)


CONFIGS: dict[str, tuple[int, TierSizes, list[tuple[int, ...]]]] = {
    "ps1": (1, TierSizes(3, 3, 3), [(1, 2), (1, 3)]),
    "ps2": (2, TierSizes(3, 2, 3), [(1, 1, 2, 2), (1, 1, 3, 3)]),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Exhaustively explore the core at small scope.")
    ap.add_argument("--config", choices=sorted(CONFIGS), action="append")
    ap.add_argument("--depth", type=int, default=8)
    args = ap.parse_args(argv)
    failed = False
    for name in args.config or sorted(CONFIGS):
        ps, sizes, seqs = CONFIGS[name]
        system = CoreSystem(ps, sizes, seqs)
        print(f"[{name}] page size {ps}, capacities {sizes.capacities}, sequences {seqs}, depth {args.depth}")
        report = explore(
            system,
            args.depth,
            progress=lambda d, s, e: print(f"  depth {d}: {s} states, {e} edges", flush=True),
        )
        print(f"[{name}] {report.summary()}")
        for trace, v in report.violations:
            failed = True
            print(f"  VIOLATION {v.invariant} at {v.where}: {v.detail}\n  after {trace}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
