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
from hicache.spec.snapshot import NodeView, Snapshot


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    where: str
    detail: str


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
                out.append(Violation("ownership", f"tier {t.name}", f"page {page} has {count} owners"))
            if not 0 <= page < s.capacity[t]:
                out.append(Violation("ownership", f"tier {t.name}", f"page {page} out of range"))
        if len(owner) != s.capacity[t]:
            lost = s.capacity[t] - len(owner)
            out.append(Violation("ownership", f"tier {t.name}", f"{lost} pages have no owner (leaked)"))
    for x in s.transfers.values():
        joined: list[int] = []
        for nid in x.nodes:
            pend = s.nodes[nid].pending[x.direction] if nid in s.nodes else None
            if pend is None:
                out.append(Violation("ownership", f"transfer #{x.id}", f"node #{nid} has no pending pages"))
            else:
                joined.extend(pend)
        if tuple(joined) != x.dst:
            out.append(Violation("ownership", f"transfer #{x.id}", "nodes' pending pages differ from dst"))
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
    are pinned; stored protected/evictable counters and the eviction index are exact."""
    out: list[Violation] = []
    want: dict[tuple[int, int], int] = Counter()
    for lease in s.leases.values():
        if not lease.alive:
            out.append(Violation("pinning", f"lease #{lease.id}", "holds a removed node"))
            continue
        for n in _path(s, lease.node):
            want[(n.id, lease.tier)] += 1
    root = s.nodes[s.root]
    if any(root.refs):
        out.append(Violation("pinning", "root", f"root refs must stay 0, got {root.refs}"))
    protected = [0, 0, 0]
    evictable = [0, 0, 0]
    for n in s.nodes.values():
        if n.id == s.root:
            continue
        for t in Tier:
            r = n.refs[t]
            if r < 0 or r != want.get((n.id, t), 0):
                out.append(Violation("pinning", _where(n), f"{t.name} refs {r}, leases say {want.get((n.id, t), 0)}"))
            pages = n.pages[t]
            if pages is None:
                if r:
                    out.append(Violation("pinning", _where(n), f"refs on an absent {t.name} copy"))
                continue
            if r:
                protected[t] += len(pages)
            else:
                evictable[t] += len(pages)
    for x in s.transfers.values():
        for nid in x.nodes:
            src = s.nodes.get(nid)
            if src is not None and src.refs[x.direction.source] <= 0:
                out.append(Violation("pinning", _where(src), f"source of {x.direction.name} #{x.id} is unpinned"))
    for t in Tier:
        if protected[t] != s.protected[t] or evictable[t] != s.evictable[t]:
            out.append(
                Violation(
                    "pinning",
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
                out.append(Violation("pinning", _where(n), f"evictable {t.name} leaf missing from the eviction index"))
    return out


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
                out.append(Violation("prefix-closure", _where(n), f"has {t.name} but parent #{parent.id} lacks it"))
    return out


def alignment(s: Snapshot) -> list[Violation]:
    """5. Node lengths are multiples of page_size; every page list covers its node."""
    out: list[Violation] = []
    ps = s.page_size
    for n in s.nodes.values():
        if n.id == s.root:
            continue
        if len(n.key) % ps:
            out.append(Violation("alignment", _where(n), f"length {len(n.key)} not a multiple of {ps}"))
            continue
        width = len(n.key) // ps
        for label, lists in (("pages", n.pages), ("pending", n.pending)):
            for i, pages in enumerate(lists):
                if pages is not None and len(pages) != width:
                    out.append(Violation("alignment", _where(n), f"{label}[{i}] has {len(pages)} pages for {width}"))
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
                out.append(Violation("structure", _where(n), f"child #{cid} is not in the tree"))
                continue
            if child.parent != n.id:
                out.append(Violation("structure", _where(child), f"parent is #{child.parent}, listed under #{n.id}"))
            if key != child.key[:ps]:
                out.append(Violation("structure", _where(child), "child key differs from its first page"))
            if cid in seen:
                out.append(Violation("structure", _where(child), "reached twice"))
                continue
            seen.add(cid)
            stack.append(cid)
    for n in s.nodes.values():
        if n.id not in seen:
            out.append(Violation("structure", _where(n), "unreachable from the root"))
        if not n.alive:
            out.append(Violation("structure", _where(n), "removed node still in the tree"))
        if n.id == s.root:
            continue
        if not n.key:
            out.append(Violation("structure", _where(n), "empty non-root node"))
        if all(p is None for p in n.pages) and all(x is None for x in n.inflight) and not n.children:
            out.append(Violation("structure", _where(n), "holds nothing and should have been removed"))
        for t in Tier:
            count = sum(1 for _, cid in n.children if cid in s.nodes and s.nodes[cid].pages[t] is not None)
            if count != n.tier_children[t]:
                out.append(
                    Violation("structure", _where(n), f"stored {t.name} child count {n.tier_children[t]} != {count}")
                )
    return out


def uniqueness(s: Snapshot) -> list[Violation]:
    """7. No physical page id appears twice among a tier's published pages."""
    out: list[Violation] = []
    for t in Tier:
        seen: dict[int, int] = {}
        for n in s.nodes.values():
            for p in n.pages[t] or ():
                if p in seen:
                    out.append(Violation("uniqueness", _where(n), f"{t.name} page {p} also in node #{seen[p]}"))
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
            out.append(Violation("declared-states", _where(n), f"(R, F) code {code} is not a live declared state"))
        for d in Direction:
            xid = n.inflight[d]
            if xid is None:
                if n.pending[d] is not None:
                    out.append(Violation("declared-states", _where(n), f"pending {d.name} pages without a transfer"))
                continue
            x = s.transfers.get(xid)
            if x is None or x.direction is not d or n.id not in x.nodes:
                out.append(
                    Violation("declared-states", _where(n), f"marked in flight {d.name} by unknown transfer #{xid}")
                )
    for x in s.transfers.values():
        for nid in x.nodes:
            member = s.nodes.get(nid)
            if member is None or member.inflight[x.direction] != x.id:
                out.append(Violation("declared-states", f"transfer #{x.id}", f"node #{nid} is not marked in flight"))
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
