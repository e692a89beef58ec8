"""Every report the invariant checker can make fires on a snapshot corrupted for it.

The snapshot comes from a real, valid cache with transfers in flight (a multi-node H2S and
a D2H under a destination lease), a request's lease, private pages and an evictable leaf;
each builder changes one view with ``dataclasses.replace``. A report with no builder, or a
code the checker emits that is not registered, fails the meta-tests.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import pytest

from hicache.core.cache import CacheCore
from hicache.core.geometry import TierSizes
from hicache.spec import invariants
from hicache.spec.invariants import REPORTS, Violation, check_all
from hicache.spec.model import Direction, Tier
from hicache.spec.snapshot import NodeView, Snapshot

L1, L2, L3 = Tier.L1, Tier.L2, Tier.L3
D2H, H2S = Direction.D2H, Direction.H2S


@dataclass(frozen=True)
class Base:
    """The valid snapshot and the ids of its parts.

    root -> u [1,2] (L1 L2, H2S in flight) -> a [3,4] (L1 L2, H2S in flight, leased L1)
                                          -> b [5,6] (L1, D2H in flight)
         -> c [7,8] (L1, an evictable leaf)
    """

    snap: Snapshot
    u: int
    a: int
    b: int
    c: int
    h2s: int  # transfer ids
    d2h: int
    lease: int  # the request's lease


@cache
def base() -> Base:
    core = CacheCore(2, TierSizes(8, 8, 8))
    p = core.allocate_l1(2)
    assert p is not None
    a = core.insert((1, 2, 3, 4), p).node
    x = core.start(D2H, a)
    assert x is not None
    core.complete(x)
    q = core.allocate_l1(1)
    assert q is not None
    b = core.insert((1, 2, 5, 6), [p[0], *q]).node
    r = core.allocate_l1(1)
    assert r is not None
    c = core.insert((7, 8), r).node
    h2s = core.start(H2S, a)  # segment u, a
    d2h = core.start(D2H, b)  # segment b; destination lease on u's L2
    assert h2s is not None and d2h is not None and d2h.dst_lease is not None
    lease = core.lock(core.match((1, 2, 3, 4)).l1)
    assert core.allocate_l1(2) is not None  # a request's private pages
    assert a.parent is not None
    snap = core.snapshot()
    return Base(snap, a.parent.id, a.id, b.id, c.id, h2s.id, d2h.id, lease.id)


def _node(s: Snapshot, nid: int, **changes: object) -> Snapshot:
    return replace(s, nodes={**s.nodes, nid: replace(s.nodes[nid], **changes)})  # type: ignore[arg-type]


def _set(values: tuple[object, ...], i: int, value: object) -> tuple[object, ...]:
    return (*values[:i], value, *values[i + 1 :])


def _free_page(s: Snapshot, t: Tier) -> int:
    return s.free[t][0]


def _take_free(s: Snapshot, t: Tier) -> tuple[Snapshot, int]:
    """A free page of ``t``, removed from the free list (to be given to someone else)."""
    page = s.free[t][0]
    return replace(s, free=_set(s.free, t, s.free[t][1:])), page  # type: ignore[arg-type]


def _pages(n: NodeView, t: Tier) -> tuple[int, ...]:
    pages = n.pages[t]
    assert pages is not None
    return pages


def multiple_owners(b: Base) -> Snapshot:
    s = b.snap
    return replace(s, free=_set(s.free, L1, (*s.free[L1], _pages(s.nodes[b.a], L1)[0])))  # type: ignore[arg-type]


def out_of_range(b: Base) -> Snapshot:
    s = b.snap
    return replace(s, free=_set(s.free, L2, (*s.free[L2], s.capacity[L2])))  # type: ignore[arg-type]


def leaked(b: Base) -> Snapshot:
    return _take_free(b.snap, L3)[0]


def no_pending(b: Base) -> Snapshot:
    n = b.snap.nodes[b.a]
    return _node(b.snap, b.a, pending=_set(n.pending, H2S, None))


def pending_not_dst(b: Base) -> Snapshot:
    s = b.snap
    x = s.transfers[b.h2s]
    return replace(s, transfers={**s.transfers, x.id: replace(x, dst=x.dst[::-1])})


def dead_lease(b: Base) -> Snapshot:
    s = b.snap
    lease = s.leases[b.lease]
    return replace(s, leases={**s.leases, lease.id: replace(lease, alive=False)})


def root_refs(b: Base) -> Snapshot:
    return _node(b.snap, b.snap.root, refs=(1, 0, 0))


def refs(b: Base) -> Snapshot:
    n = b.snap.nodes[b.c]
    return _node(b.snap, b.c, refs=_set(n.refs, L1, 1))


def refs_on_absent(b: Base) -> Snapshot:
    n = b.snap.nodes[b.b]
    return _node(b.snap, b.b, refs=_set(n.refs, L3, 1))


def source_unpinned(b: Base) -> Snapshot:
    n = b.snap.nodes[b.b]
    return _node(b.snap, b.b, refs=_set(n.refs, L1, 0))


def transfer_lease(b: Base) -> Snapshot:
    s = b.snap
    x = s.transfers[b.d2h]
    return replace(s, transfers={**s.transfers, x.id: replace(x, dst_lease=None)})


def counters(b: Base) -> Snapshot:
    s = b.snap
    return replace(s, protected=_set(s.protected, L2, s.protected[L2] + 1))  # type: ignore[arg-type]


def unindexed(b: Base) -> Snapshot:
    s = b.snap
    return replace(s, index=_set(s.index, L1, frozenset(e for e in s.index[L1] if e[0] != b.c)))  # type: ignore[arg-type]


def parent_lacks_copy(b: Base) -> Snapshot:
    s, page = _take_free(b.snap, L3)
    n = s.nodes[b.b]
    return _node(s, b.b, pages=_set(n.pages, L3, (page,)))


def length(b: Base) -> Snapshot:
    n = b.snap.nodes[b.c]
    return _node(b.snap, b.c, key=(*n.key, 9))


def pages_width(b: Base) -> Snapshot:
    s, page = _take_free(b.snap, L1)
    n = s.nodes[b.c]
    return _node(s, b.c, pages=_set(n.pages, L1, (*_pages(n, L1), page)))


def pending_width(b: Base) -> Snapshot:
    n = b.snap.nodes[b.a]
    pending = n.pending[H2S]
    assert pending is not None
    return _node(b.snap, b.a, pending=_set(n.pending, H2S, (*pending, 7)))


def missing_child(b: Base) -> Snapshot:
    n = b.snap.nodes[b.u]
    return _node(b.snap, b.u, children=(*n.children, ((9, 9), 999)))


def parent(b: Base) -> Snapshot:
    return _node(b.snap, b.b, parent=b.a)


def child_key(b: Base) -> Snapshot:
    n = b.snap.nodes[b.u]
    return _node(b.snap, b.u, children=tuple(((9, 9), cid) if cid == b.b else (k, cid) for k, cid in n.children))


def reached_twice(b: Base) -> Snapshot:
    s = b.snap
    return _node(s, s.root, children=(*s.nodes[s.root].children, ((3, 4), b.a)))


def unreachable(b: Base) -> Snapshot:
    s = b.snap
    return _node(s, s.root, children=tuple(kc for kc in s.nodes[s.root].children if kc[1] != b.c))


def removed_node(b: Base) -> Snapshot:
    return _node(b.snap, b.c, alive=False)


def empty_key(b: Base) -> Snapshot:
    return _node(b.snap, b.c, key=())


def hollow(b: Base) -> Snapshot:
    return _node(b.snap, b.c, pages=(None, None, None))


def tier_children(b: Base) -> Snapshot:
    n = b.snap.nodes[b.u]
    return _node(b.snap, b.u, tier_children=_set(n.tier_children, L3, 1))


def uniqueness(b: Base) -> Snapshot:
    n = b.snap.nodes[b.c]
    return _node(b.snap, b.c, pages=_set(n.pages, L1, (_pages(b.snap.nodes[b.b], L1)[0],)))


def undeclared(b: Base) -> Snapshot:
    n = b.snap.nodes[b.c]
    return _node(b.snap, b.c, inflight=_set(n.inflight, Direction.S2H, b.d2h))  # L1 + S2H: no such state


def pending_without_transfer(b: Base) -> Snapshot:
    n = b.snap.nodes[b.c]
    return _node(b.snap, b.c, pending=_set(n.pending, D2H, (_free_page(b.snap, L2),)))


def unknown_transfer(b: Base) -> Snapshot:
    n = b.snap.nodes[b.c]
    return _node(b.snap, b.c, inflight=_set(n.inflight, D2H, 999))


def member_not_marked(b: Base) -> Snapshot:
    n = b.snap.nodes[b.b]
    return _node(b.snap, b.b, inflight=_set(n.inflight, D2H, None))


BUILDERS: dict[str, Callable[[Base], Snapshot]] = {
    "ownership.multiple-owners": multiple_owners,
    "ownership.out-of-range": out_of_range,
    "ownership.leaked": leaked,
    "ownership.no-pending": no_pending,
    "ownership.pending-not-dst": pending_not_dst,
    "pinning.dead-lease": dead_lease,
    "pinning.root-refs": root_refs,
    "pinning.refs": refs,
    "pinning.refs-on-absent": refs_on_absent,
    "pinning.source-unpinned": source_unpinned,
    "pinning.transfer-lease": transfer_lease,
    "pinning.counters": counters,
    "pinning.unindexed": unindexed,
    "prefix-closure.parent-lacks-copy": parent_lacks_copy,
    "alignment.length": length,
    "alignment.pages": pages_width,
    "alignment.pending": pending_width,
    "structure.missing-child": missing_child,
    "structure.parent": parent,
    "structure.child-key": child_key,
    "structure.reached-twice": reached_twice,
    "structure.unreachable": unreachable,
    "structure.removed-node": removed_node,
    "structure.empty-key": empty_key,
    "structure.hollow": hollow,
    "structure.tier-children": tier_children,
    "uniqueness.page": uniqueness,
    "declared-states.undeclared": undeclared,
    "declared-states.pending-without-transfer": pending_without_transfer,
    "declared-states.unknown-transfer": unknown_transfer,
    "declared-states.member-not-marked": member_not_marked,
}


WHERE: dict[str, Callable[[Base], str]] = {
    "ownership.multiple-owners": lambda b: "tier L1",
    "ownership.out-of-range": lambda b: "tier L2",
    "ownership.leaked": lambda b: "tier L3",
    "ownership.no-pending": lambda b: f"transfer #{b.h2s}",
    "ownership.pending-not-dst": lambda b: f"transfer #{b.h2s}",
    "pinning.dead-lease": lambda b: f"lease #{b.lease}",
    "pinning.root-refs": lambda b: "root",
    "pinning.refs": lambda b: f"node #{b.c}",
    "pinning.refs-on-absent": lambda b: f"node #{b.b}",
    "pinning.source-unpinned": lambda b: f"node #{b.b}",
    "pinning.transfer-lease": lambda b: f"transfer #{b.d2h}",
    "pinning.counters": lambda b: "tier L2",
    "pinning.unindexed": lambda b: f"node #{b.c}",
    "prefix-closure.parent-lacks-copy": lambda b: f"node #{b.b}",
    "alignment.length": lambda b: f"node #{b.c}",
    "alignment.pages": lambda b: f"node #{b.c}",
    "alignment.pending": lambda b: f"node #{b.a}",
    "structure.missing-child": lambda b: f"node #{b.u}",
    "structure.parent": lambda b: f"node #{b.b}",
    "structure.child-key": lambda b: f"node #{b.b}",
    "structure.reached-twice": lambda b: f"node #{b.a}",
    "structure.unreachable": lambda b: f"node #{b.c}",
    "structure.removed-node": lambda b: f"node #{b.c}",
    "structure.empty-key": lambda b: f"node #{b.c}",
    "structure.hollow": lambda b: f"node #{b.c}",
    "structure.tier-children": lambda b: f"node #{b.u}",
    "uniqueness.page": lambda b: f"node #{b.c}",  # the later of the two nodes
    "declared-states.undeclared": lambda b: f"node #{b.c}",
    "declared-states.pending-without-transfer": lambda b: f"node #{b.c}",
    "declared-states.unknown-transfer": lambda b: f"node #{b.c}",
    "declared-states.member-not-marked": lambda b: f"transfer #{b.d2h}",
}
"""Where each report must point for its corruption above."""


DETAIL: dict[str, str] = {
    "ownership.multiple-owners": r"page \d+ has 2 owners",
    "ownership.out-of-range": r"page \d+ out of range",
    "ownership.leaked": r"pages \[\d+(, \d+)*\] have no owner",
    "ownership.no-pending": r"node #\d+ has no pending pages",
    "ownership.pending-not-dst": r"nodes' pending pages differ from dst",
    "pinning.dead-lease": r"holds a removed node",
    "pinning.root-refs": r"root refs must stay 0, got \(1, 0, 0\)",
    "pinning.refs": r"L1 refs 1, leases say 0",
    "pinning.refs-on-absent": r"refs on an absent L3 copy",
    "pinning.source-unpinned": r"source of D2H #\d+ is unpinned",
    "pinning.transfer-lease": r"source or destination lease not held",
    "pinning.counters": r"counters protected=\d+ evictable=\d+, recomputed \d+ / \d+",
    "pinning.unindexed": r"evictable L1 leaf missing from the eviction index",
    "prefix-closure.parent-lacks-copy": r"has L3 but parent #\d+ lacks it",
    "alignment.length": r"length 3 not a multiple of 2",
    "alignment.pages": r"L1 has 2 pages for 1",
    "alignment.pending": r"H2S pending 2 pages for 1",
    "structure.missing-child": r"child #999 is not in the tree",
    "structure.parent": r"parent is #\d+, listed under #\d+",
    "structure.child-key": r"child key differs from its first page",
    "structure.reached-twice": r"reached twice",
    "structure.unreachable": r"unreachable from the root",
    "structure.removed-node": r"removed node still in the tree",
    "structure.empty-key": r"empty non-root node",
    "structure.hollow": r"holds nothing and should have been removed",
    "structure.tier-children": r"stored L3 child count 1 != 0",
    "uniqueness.page": r"L1 page \d+ also in node #\d+",
    "declared-states.undeclared": r"\(R, F\) code \d+ is not a live declared state",
    "declared-states.pending-without-transfer": r"pending D2H pages without a transfer",
    "declared-states.unknown-transfer": r"marked in flight D2H by unknown transfer #999",
    "declared-states.member-not-marked": r"node #\d+ is not marked in flight",
}
"""What each report's detail says for its corruption above (a full match)."""


def test_the_base_snapshot_is_valid_and_busy() -> None:
    """The unmodified snapshot reports nothing, and holds what the builders corrupt."""
    b = base()
    s = b.snap
    assert check_all(s) == []
    assert len(s.transfers) == 2 and len(s.transfers[b.h2s].nodes) == 2
    assert b.lease in s.leases and s.private and (b.c, s.nodes[b.c].stamp[L1]) in s.index[L1]


@pytest.mark.parametrize("code", sorted(BUILDERS))
def test_each_report_fires_on_its_corruption(code: str) -> None:
    """The corrupted snapshot is reported with exactly this code, under its invariant,
    pointing at the corrupted part, with the detail that says what is wrong."""
    found = check_all(BUILDERS[code](base()))
    mine = [v.detail for v in found if (v.code, v.where) == (code, WHERE[code](base()))]
    assert mine, found
    assert any(re.fullmatch(DETAIL[code], detail) for detail in mine), mine
    assert all(v.invariant == v.code.partition(".")[0] for v in found)
    assert all(isinstance(v.detail, str) and v.detail for v in found)


def test_every_report_has_a_corruption_test() -> None:
    """A registered report without a builder here fails (and a builder for no report)."""
    assert set(BUILDERS) == set(REPORTS) == set(WHERE) == set(DETAIL)


def test_the_checker_emits_only_registered_codes() -> None:
    """Every code the checker's source names, and every code emitted on any corruption
    above, is in REPORTS; every registered code is named in the source."""
    named: set[str] = set()
    for fn in ast.parse(inspect.getsource(invariants)).body:
        # NOTE: a mutation tool adds mutated copies of each function (``*__mutmut_<n>``).
        if not isinstance(fn, ast.FunctionDef) or re.search(r"__mutmut_\d+$", fn.name):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_v":
                code = node.args[0]
                assert isinstance(code, ast.Constant) and isinstance(code.value, str), f"line {node.lineno}"
                named.add(code.value)
    assert named == set(REPORTS)
    emitted = {v.code for build in BUILDERS.values() for v in check_all(build(base()))}
    assert emitted <= set(REPORTS), emitted - set(REPORTS)


def test_violation_keeps_its_three_positional_fields() -> None:
    """Callers that build ``Violation(invariant, where, detail)`` keep working."""
    v = Violation("ordering", "here", "what")
    assert (v.invariant, v.where, v.detail, v.code) == ("ordering", "here", "what", "")


@pytest.mark.parametrize(
    "end", ["src gone", "src other tier", "src other node", "dst other tier", "dst other node", "dst at root"]
)
def test_a_transfer_must_hold_both_its_leases(end: str) -> None:
    """Each end of "pinning.transfer-lease": the source lease is held, in the source tier,
    on the segment's bottom; the destination lease, on the segment's parent in the target
    tier, exists exactly when that parent is not the root."""
    b = base()
    s = b.snap
    h2s, d2h = s.transfers[b.h2s], s.transfers[b.d2h]
    leases = dict(s.leases)
    if end == "src gone":
        del leases[h2s.src_lease]
    elif end == "src other tier":
        leases[h2s.src_lease] = replace(leases[h2s.src_lease], tier=L1)
    elif end == "src other node":
        leases[h2s.src_lease] = replace(leases[h2s.src_lease], node=b.u)
    elif end.startswith("dst other"):
        assert d2h.dst_lease is not None
        change = {"tier": L1} if end == "dst other tier" else {"node": b.a}
        leases[d2h.dst_lease] = replace(leases[d2h.dst_lease], **change)
    else:
        s = replace(s, transfers={**s.transfers, h2s.id: replace(h2s, dst_lease=b.lease)})
    codes = {v.code for v in check_all(replace(s, leases=leases))}
    assert "pinning.transfer-lease" in codes


def test_a_transfer_listing_a_node_not_in_the_tree_is_reported_not_raised() -> None:
    """A transfer naming an unknown node is a report ("ownership.no-pending"), not a crash."""
    b = base()
    s = b.snap
    x = s.transfers[b.h2s]
    found = check_all(replace(s, transfers={**s.transfers, x.id: replace(x, nodes=(*x.nodes, 999))}))
    assert ("ownership.no-pending", f"transfer #{x.id}") in {(v.code, v.where) for v in found}
