"""The structural invariants of DESIGN.md §4 as named predicates over a :class:`Snapshot`.

Each predicate returns the list of violations it finds (empty when it holds). Invariant 3
(ordering: completion -> publish -> ``cached_len``) is about time, not structure: the
stateful tests check it with content tags, and the core's tracing mode checks every state
change against the spec (the dynamic half of invariant 8).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from hicache.spec.model import DIR_BIT, STATE_BY_CODE, TIER_BIT, Direction, RunState, Tier, may_evict
from hicache.spec.snapshot import NodeView, Snapshot, TransferView


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant: its name, where, what, and the report's stable ``code``
    (a key of :data:`REPORTS` for the checks of this module)."""

    invariant: str
    where: str
    detail: str
    code: str = ""


REPORTS: dict[str, str] = {
    "ownership.multiple-owners": "a page is owned twice (free, published, pending, private)",
    "ownership.out-of-range": "a page id outside [0, capacity)",
    "ownership.leaked": "a page nobody owns",
    "ownership.no-pending": "a transfer's node holds no pending pages for it",
    "ownership.pending-not-dst": "a transfer's nodes' pending pages are not its dst",
    "pinning.dead-lease": "a lease holds a removed node",
    "pinning.root-refs": "the root has refs",
    "pinning.refs": "a copy's refs differ from the leases holding it",
    "pinning.refs-on-absent": "refs on a copy that is not there",
    "pinning.source-unpinned": "a transfer's source copy is not pinned",
    "pinning.transfer-lease": "a transfer's leases are not the held locks on its source path and its parent",
    "pinning.counters": "stored protected/evictable counters differ from the tree",
    "pinning.unindexed": "an evictable leaf copy is missing from the eviction index",
    "prefix-closure.parent-lacks-copy": "a copy whose parent (not the root) lacks that tier",
    "alignment.length": "a node length not a multiple of page_size",
    "alignment.pages": "a published page list not covering its node",
    "alignment.pending": "a pending page list not covering its node",
    "structure.missing-child": "a child id not in the tree",
    "structure.parent": "a child's parent pointer names another node",
    "structure.child-key": "a child's dict key is not its first page",
    "structure.reached-twice": "a node listed under two parents (or twice)",
    "structure.unreachable": "a node not reachable from the root",
    "structure.removed-node": "a removed node still in the tree",
    "structure.empty-key": "a non-root node with an empty key",
    "structure.hollow": "a node with no copy, nothing in flight and no children",
    "structure.tier-children": "a stored per-tier child count that is wrong",
    "uniqueness.page": "a page published by two nodes of one tier",
    "declared-states.undeclared": "a node whose (R, F) is not a live declared state",
    "declared-states.pending-without-transfer": "pending pages with no transfer in flight",
    "declared-states.unknown-transfer": "in flight by a transfer that does not list the node",
    "declared-states.member-not-marked": "a transfer's node not marked in flight by it",
}
"""Every report the checks of this module can make: ``Violation.code`` -> what it means."""


def _v(code: str, where: str, detail: str) -> Violation:
    return Violation(code.partition(".")[0], where, detail, code)


def _where(n: NodeView) -> str:
    return f"node #{n.id}"


def ownership(s: Snapshot) -> list[Violation]:
    """1. Per tier every page is free, published, a transfer's private dst, or a request's
    private L1 page: exactly one of them, all together exactly the capacity."""
    out: list[Violation] = []
    for t in Tier:
        owner: Counter[int] = Counter(s.free[t])
        for n in s.nodes.values():
            pages = n.pages[t]
            if pages is not None:
                owner.update(pages)
        for x in s.transfers.values():
            if x.direction.target is t:
                owner.update(x.dst)
        if t is Tier.L1:
            owner.update(s.private)
        for page, count in owner.items():
            if count > 1:
                out.append(_v("ownership.multiple-owners", f"tier {t.name}", f"page {page} has {count} owners"))
            if not 0 <= page < s.capacity[t]:
                out.append(_v("ownership.out-of-range", f"tier {t.name}", f"page {page} out of range"))
        lost = [p for p in range(s.capacity[t]) if p not in owner]
        if lost:
            out.append(_v("ownership.leaked", f"tier {t.name}", f"pages {lost} have no owner"))
    for x in s.transfers.values():
        joined: list[int] = []
        for nid in x.nodes:
            pend = s.nodes[nid].pending[x.direction] if nid in s.nodes else None
            if pend is None:
                out.append(_v("ownership.no-pending", f"transfer #{x.id}", f"node #{nid} has no pending pages"))
            else:
                joined.extend(pend)
        if tuple(joined) != x.dst:
            out.append(_v("ownership.pending-not-dst", f"transfer #{x.id}", "nodes' pending pages differ from dst"))
    return out


def _path(s: Snapshot, nid: int) -> list[NodeView]:
    out = []
    n = s.nodes.get(nid)
    while n is not None and n.parent is not None:
        out.append(n)
        n = s.nodes.get(n.parent)
    return out


def pinning(s: Snapshot) -> list[Violation]:
    """2. Refs equal the leases holding each copy (>= 0, root fixed at 0); transfer sources
    are pinned and each transfer holds its own two leases; stored protected/evictable
    counters and the eviction index are exact."""
    out: list[Violation] = []
    want: dict[tuple[int, int], int] = Counter()
    for lease in s.leases.values():
        if not lease.alive:
            out.append(_v("pinning.dead-lease", f"lease #{lease.id}", "holds a removed node"))
            continue
        for n in _path(s, lease.node):
            want[(n.id, lease.tier)] += 1
    root = s.nodes[s.root]
    if any(root.refs):
        out.append(_v("pinning.root-refs", "root", f"root refs must stay 0, got {root.refs}"))
    protected = [0, 0, 0]
    evictable = [0, 0, 0]
    for n in s.nodes.values():
        if n.id == s.root:
            continue
        for t in Tier:
            r = n.refs[t]
            if r != want.get((n.id, t), 0):  # leases count from 0: a negative count differs too
                out.append(_v("pinning.refs", _where(n), f"{t.name} refs {r}, leases say {want.get((n.id, t), 0)}"))
            pages = n.pages[t]
            if pages is None:
                if r:
                    out.append(_v("pinning.refs-on-absent", _where(n), f"refs on an absent {t.name} copy"))
                continue
            if r:
                protected[t] += len(pages)
            else:
                evictable[t] += len(pages)
    for x in s.transfers.values():
        for nid in x.nodes:
            src = s.nodes.get(nid)
            if src is not None and src.refs[x.direction.source] <= 0:
                out.append(
                    _v("pinning.source-unpinned", _where(src), f"source of {x.direction.name} #{x.id} is unpinned")
                )
    for x in s.transfers.values():
        if not _holds_its_leases(s, x):
            out.append(_v("pinning.transfer-lease", f"transfer #{x.id}", "source or destination lease not held"))
    for t in Tier:
        if protected[t] != s.protected[t] or evictable[t] != s.evictable[t]:
            out.append(
                _v(
                    "pinning.counters",
                    f"tier {t.name}",
                    f"counters protected={s.protected[t]} evictable={s.evictable[t]}, "
                    f"recomputed {protected[t]} / {evictable[t]}",
                )
            )
        for n in s.nodes.values():
            if n.id == s.root or n.pages[t] is None or n.refs[t] or n.tier_children[t]:
                continue
            resident = frozenset(u for u in Tier if n.pages[u] is not None)
            flying = frozenset(d for d in Direction if n.inflight[d] is not None)
            if may_evict(t, resident, flying) and (n.id, n.stamp[t]) not in s.index[t]:
                out.append(
                    _v("pinning.unindexed", _where(n), f"evictable {t.name} leaf missing from the eviction index")
                )
    return out


def _holds_its_leases(s: Snapshot, x: TransferView) -> bool:
    """The source lease locks the segment's bottom node in the source tier; the destination
    lease locks the segment's parent in the target tier (none when that is the root)."""
    src = s.leases.get(x.src_lease)
    if src is None or src.tier is not x.direction.source or not x.nodes or src.node != x.nodes[-1]:
        return False
    top = s.nodes.get(x.nodes[0])
    parent = None if top is None else top.parent
    if parent == s.root:
        return x.dst_lease is None
    dst = None if x.dst_lease is None else s.leases.get(x.dst_lease)
    return dst is not None and dst.tier is x.direction.target and dst.node == parent


def prefix_closure(s: Snapshot) -> list[Violation]:
    """4. A node with a copy in t has a parent that is the root or has a copy in t."""
    out: list[Violation] = []
    for n in s.nodes.values():
        if n.parent is None or n.parent == s.root:
            continue
        parent = s.nodes.get(n.parent)
        if parent is None:
            continue
        for t in Tier:
            if n.pages[t] is not None and parent.pages[t] is None:
                out.append(
                    _v("prefix-closure.parent-lacks-copy", _where(n), f"has {t.name} but parent #{parent.id} lacks it")
                )
    return out


def alignment(s: Snapshot) -> list[Violation]:
    """5. Node lengths are multiples of page_size; every page list covers its node."""
    out: list[Violation] = []
    ps = s.page_size
    for n in s.nodes.values():
        if n.id == s.root:
            continue
        if len(n.key) % ps:
            out.append(_v("alignment.length", _where(n), f"length {len(n.key)} not a multiple of {ps}"))
            continue
        width = len(n.key) // ps
        for t in Tier:
            pages = n.pages[t]
            if pages is not None and len(pages) != width:
                out.append(_v("alignment.pages", _where(n), f"{t.name} has {len(pages)} pages for {width}"))
        for d in Direction:
            pending = n.pending[d]
            if pending is not None and len(pending) != width:
                out.append(_v("alignment.pending", _where(n), f"{d.name} pending {len(pending)} pages for {width}"))
    return out


def structure(s: Snapshot) -> list[Violation]:
    """6. Parent/child pointers agree, child keys are unique and right, no empty non-root
    node, no node with nothing in any tier, nothing in flight and no children; every node
    is reachable from the root."""
    out: list[Violation] = []
    ps = s.page_size
    seen = {s.root}
    stack = [s.root]
    while stack:
        n = s.nodes[stack.pop()]
        for key, cid in n.children:
            child = s.nodes.get(cid)
            if child is None:
                out.append(_v("structure.missing-child", _where(n), f"child #{cid} is not in the tree"))
                continue
            if child.parent != n.id:
                out.append(_v("structure.parent", _where(child), f"parent is #{child.parent}, listed under #{n.id}"))
            if key != child.key[:ps]:
                out.append(_v("structure.child-key", _where(child), "child key differs from its first page"))
            if cid in seen:
                out.append(_v("structure.reached-twice", _where(child), "reached twice"))
                continue
            seen.add(cid)
            stack.append(cid)
    for n in s.nodes.values():
        if n.id not in seen:
            out.append(_v("structure.unreachable", _where(n), "unreachable from the root"))
        if not n.alive:
            out.append(_v("structure.removed-node", _where(n), "removed node still in the tree"))
        for t in Tier:
            count = sum(1 for _, cid in n.children if cid in s.nodes and s.nodes[cid].pages[t] is not None)
            if count != n.tier_children[t]:
                out.append(
                    _v(
                        "structure.tier-children",
                        _where(n),
                        f"stored {t.name} child count {n.tier_children[t]} != {count}",
                    )
                )
        if n.id == s.root:
            continue
        if not n.key:
            out.append(_v("structure.empty-key", _where(n), "empty non-root node"))
        if all(p is None for p in n.pages) and all(x is None for x in n.inflight) and not n.children:
            out.append(_v("structure.hollow", _where(n), "holds nothing and should have been removed"))
    return out


def uniqueness(s: Snapshot) -> list[Violation]:
    """7. No physical page id appears twice among a tier's published pages."""
    out: list[Violation] = []
    for t in Tier:
        seen: dict[int, int] = {}
        for n in s.nodes.values():
            for p in n.pages[t] or ():
                if p in seen:
                    out.append(_v("uniqueness.page", _where(n), f"{t.name} page {p} also in node #{seen[p]}"))
                seen[p] = n.id
    return out


def declared_states(s: Snapshot) -> list[Violation]:
    """8. Every node's (R, F) is a declared state, and its in-flight marks match transfers."""
    out: list[Violation] = []
    for n in s.nodes.values():
        if n.id == s.root:
            continue
        code = sum(TIER_BIT[t] for t in Tier if n.pages[t] is not None)
        code |= sum(DIR_BIT[d] for d in Direction if n.inflight[d] is not None)
        state = STATE_BY_CODE[code]
        if state is None or state is RunState.EMPTY:
            out.append(_v("declared-states.undeclared", _where(n), f"(R, F) code {code} is not a live declared state"))
        for d in Direction:
            xid = n.inflight[d]
            if xid is None:
                if n.pending[d] is not None:
                    out.append(
                        _v(
                            "declared-states.pending-without-transfer",
                            _where(n),
                            f"pending {d.name} pages without a transfer",
                        )
                    )
                continue
            x = s.transfers.get(xid)
            if x is None or x.direction is not d or n.id not in x.nodes:
                out.append(
                    _v(
                        "declared-states.unknown-transfer",
                        _where(n),
                        f"marked in flight {d.name} by unknown transfer #{xid}",
                    )
                )
    for x in s.transfers.values():
        for nid in x.nodes:
            member = s.nodes.get(nid)
            if member is None or member.inflight[x.direction] != x.id:
                out.append(
                    _v("declared-states.member-not-marked", f"transfer #{x.id}", f"node #{nid} is not marked in flight")
                )
    return out


INVARIANTS: dict[str, Callable[[Snapshot], list[Violation]]] = {
    "uniqueness": uniqueness,
    "ownership": ownership,
    "pinning": pinning,
    "prefix-closure": prefix_closure,
    "alignment": alignment,
    "structure": structure,
    "declared-states": declared_states,
}
"""Invariants 1, 2, 4, 5, 6, 7, 8 in the order they are checked."""


def check_all(s: Snapshot) -> list[Violation]:
    out: list[Violation] = []
    for predicate in INVARIANTS.values():
        out.extend(predicate(s))
    return out
