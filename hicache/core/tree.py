"""``HiRadixTree``: one token topology for all three tiers (DESIGN.md §3).

Each node records, per tier, its physical pages (or none), a ref count and an LRU stamp.
The tree owns structure, residency, locks and the eviction index; it never allocates or
frees physical pages (``CacheCore`` does, through the allocators) and never moves bytes.

Every change of a run's ``(R, F)`` goes through :meth:`HiRadixTree.expect` (the spec's
compiled table, consulted *before* anything changes) and, in tracing mode,
:meth:`HiRadixTree.record` (which checks afterwards that the run landed where the spec said).

Match lengths are page aligned; for a prompt that diverges inside a node, the handle points
at that node and the length stops at the last whole matching page::

    prompt   a b | c d | e f | x y            (page_size 2)
    path     [a b c d] -> [e f g h]
    L1       ^^^^^^^^^    ^^^^^^^^^           L1 length 6: node [e f g h], 1 of 2 pages
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hicache.core.node import Key, Lease, Node
from hicache.errors import HandleError, IntegrityError, MisuseError, TransitionRefused
from hicache.spec.model import Event, RunState, Tier, evict_event, step

_TIERS = (Tier.L1, Tier.L2, Tier.L3)


@dataclass(frozen=True, slots=True)
class TierMatch:
    """The longest page-aligned prefix of a prompt resident in one tier.

    ``node`` is the deepest node the match touches (the root when ``length`` is 0);
    ``version`` detects a handle whose copy has since been dropped.
    """

    tier: Tier
    length: int
    node: Node
    version: int


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Per-tier matches of one prompt. ``length(t)`` is page aligned."""

    l1: TierMatch
    l2: TierMatch
    l3: TierMatch

    def __getitem__(self, tier: Tier) -> TierMatch:
        return (self.l1, self.l2, self.l3)[tier]

    @property
    def lengths(self) -> tuple[int, int, int]:
        return (self.l1.length, self.l2.length, self.l3.length)


@dataclass(frozen=True, slots=True)
class TraceEntry:
    node: int  # node id, or -1 for a private run
    before: RunState
    event: Event
    after: RunState


class HiRadixTree:
    """Topology, residency, locks and per-tier LRU eviction index. See module docstring."""

    def __init__(self, page_size: int, *, tracing: bool = False) -> None:
        self.page_size = page_size
        self._ids = itertools.count(1)
        self.root = Node(id=0, key=(), parent=None)
        self.nodes: dict[int, Node] = {0: self.root}
        self._clock = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self.leases: dict[int, Lease] = {}
        # NOTE: "protected" counts pages held by a lease (refs > 0); "evictable" counts
        # unlocked published pages, all of which eviction can reach leaf by leaf.
        self.protected = [0, 0, 0]
        self.evictable = [0, 0, 0]
        self._heaps: list[list[tuple[int, int, Node]]] = [[], [], []]
        self.tracing = tracing
        self.walks = 0  # root-to-leaf walks (match, insert): bookkeeping cost per request
        self.coverage: Counter[tuple[RunState, Event]] = Counter()
        self.trace: list[TraceEntry] = []

    # -- spec ------------------------------------------------------------------------------

    def expect(self, node: Node | None, event: Event) -> RunState:
        """The state ``event`` leads to from ``node``'s state (None: a private run).

        Raises TransitionRefused, before anything changes, if the spec refuses it.
        """
        before = RunState.L1_PRIVATE if node is None else node.state
        after = None if before is None else step(before, event)
        if after is None:
            where = "a private run" if node is None else repr(node)
            raise TransitionRefused(f"spec refuses {event.value!r} on {where}")
        return after

    def expect_from(self, state: RunState, event: Event) -> RunState:
        """The state ``event`` leads to from ``state`` (a run not in the tree yet)."""
        after = step(state, event)
        if after is None:
            raise TransitionRefused(f"spec refuses {event.value!r} on a {state.name} run")
        return after

    def record(self, node: Node | None, before: RunState, event: Event, after: RunState) -> None:
        """Tracing mode: check the run landed in ``after`` and log the transition."""
        if not self.tracing:
            return
        if node is not None:
            actual = node.state if node.alive else RunState.REMOVED
            if actual is not after:
                raise IntegrityError(
                    "declared-states",
                    repr(node),
                    f"{before.name} --{event.value}--> {actual} but the spec says {after.name}",
                )
        self.coverage[(before, event)] += 1
        self.trace.append(TraceEntry(-1 if node is None else node.id, before, event, after))
        if len(self.trace) > 100_000:
            del self.trace[:50_000]

    # -- matching --------------------------------------------------------------------------

    def page_key(self, tokens: Sequence[int], start: int) -> Key:
        return tuple(tokens[start : start + self.page_size])

    def common(self, key: Key, tokens: tuple[int, ...], start: int) -> int:
        """Length of the page-aligned common prefix of ``key`` and ``tokens[start:]``."""
        n = len(key)
        if tokens[start : start + n] == key:
            return n
        # NOTE: a binary search over whole pages, each probe one C-level slice compare: a
        # page-by-page walk made two slices per page (0.2 ms over a 3,500-token key), on
        # the path from a request's arrival to its restore's first copy.
        ps = self.page_size
        lo, hi = 1, -(-n // ps)  # pages: the first matched already (the child's dict key), all did not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if tokens[start : start + mid * ps] == key[: mid * ps]:
                lo = mid
            else:
                hi = mid
        return lo * ps

    def match_prefixes(self, tokens: tuple[int, ...]) -> MatchResult:
        """Per tier, the longest page-aligned prefix of ``tokens`` resident in that tier.

        One walk from the root. This operation does not modify the tree.
        """
        ps = self.page_size
        self.walks += 1
        limit = len(tokens) - len(tokens) % ps
        lengths = [0, 0, 0]
        found: list[Node] = [self.root, self.root, self.root]
        node = self.root
        i = 0
        while i < limit:
            child = node.children.get(tokens[i : i + ps])
            if child is None:
                break
            k = self.common(child.key, tokens, i)
            if i + k > limit:
                k = limit - i
            pages = child.pages
            for t in (0, 1, 2):  # plain ints: IntEnum indexing costs ~10x in this loop
                if pages[t] is not None and lengths[t] == i:
                    lengths[t] = i + k
                    found[t] = child
            if k < len(child.key):
                break
            i += k
            node = child
        return MatchResult(*(TierMatch(t, lengths[t], found[t], found[t].version[t]) for t in _TIERS))

    def path(self, node: Node) -> list[Node]:
        """Nodes from just below the root down to ``node``."""
        out: list[Node] = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def depth_tokens(self, node: Node) -> int:
        return sum(len(n.key) for n in self.path(node))

    def tokens_of(self, node: Node) -> tuple[int, ...]:
        out: list[int] = []
        for n in self.path(node):
            out.extend(n.key)
        return tuple(out)

    def pages_of(self, match: TierMatch) -> list[int]:
        """The physical pages of ``match`` in token order (len = length // page_size)."""
        self.check_fresh(match.node, match.tier, match.version)
        out: list[int] = []
        for n in self.path(match.node):
            pages = n.pages[match.tier]
            if pages is None:
                raise IntegrityError("prefix-closure", repr(n), f"matched path lacks a {match.tier.name} copy")
            out.extend(pages)
        return out[: match.length // self.page_size]

    # -- locks -----------------------------------------------------------------------------

    def check_fresh(self, node: Node, tier: Tier, version: int) -> None:
        """Raise HandleError if ``node``'s copy in ``tier`` was dropped since ``version``."""
        if node is self.root:
            return
        if not node.alive or node.pages[tier] is None or node.version[tier] != version:
            raise HandleError(f"stale handle: the {tier.name} copy of {node!r} is gone")

    def lock(self, match: TierMatch) -> Lease:
        """Pin ``match``'s copy on the whole root-to-node path so it cannot be evicted."""
        self.check_fresh(match.node, match.tier, match.version)
        return self.lock_node(match.node, match.tier, match.length)

    def lock_node(self, node: Node, tier: Tier, length: int | None = None, *, touch: bool = True) -> Lease:
        """Pin ``tier``'s copy on the root..``node`` path. ``touch`` refreshes its LRU stamps
        (a use); a transfer's own pins do not touch, so backing a run up leaves it as old as
        it was (write_back evicts exactly the victim it backed up)."""
        t = tier.value
        now = next(self._clock) if touch else 0
        n: Node | None = node
        while n is not None and n.parent is not None:
            pages = n.pages[t]
            if pages is None:
                raise IntegrityError("prefix-closure", repr(n), f"locking a path that lacks a {tier.name} copy")
            if n.refs[t] == 0:
                self.protected[t] += len(pages)
                self.evictable[t] -= len(pages)
            n.refs[t] += 1
            if touch:
                n.stamp[t] = now
            n = n.parent
        lease = Lease(next(self._lease_ids), tier, node, self.depth_tokens(node) if length is None else length)
        self.leases[lease.id] = lease
        return lease

    def release(self, lease: Lease) -> None:
        """Give back a lease. Releasing twice, or a lease this tree never gave, raises."""
        if lease.released or self.leases.get(lease.id) is not lease:
            raise HandleError(f"lease #{lease.id} on {lease.tier.name} was already released or is unknown")
        lease.released = True
        del self.leases[lease.id]
        t = lease.tier.value
        n: Node | None = lease.node
        while n is not None and n.parent is not None:
            n.refs[t] -= 1
            if n.refs[t] == 0:
                pages = n.pages[t]
                assert pages is not None
                self.protected[t] -= len(pages)
                self.evictable[t] += len(pages)
                self.push_candidate(n, lease.tier)
            n = n.parent

    # -- structure -------------------------------------------------------------------------

    def new_node(self, key: Key, parent: Node) -> Node:
        node = Node(id=next(self._ids), key=key, parent=parent)
        parent.children[key[: self.page_size]] = node
        self.nodes[node.id] = node
        return node

    def split(self, node: Node, at: int) -> Node:
        """Split ``node`` after ``at`` tokens; returns the new upper node.

        ``node`` keeps the lower part, so handles and leases on it stay valid. Every tier's
        pages, refs, stamps and every in-flight transfer's private pages are split too.
        """
        ps = self.page_size
        if at <= 0 or at >= len(node.key) or at % ps:
            raise MisuseError(f"cannot split {node!r} at {at}")
        parent = node.parent
        assert parent is not None
        upper = Node(id=next(self._ids), key=node.key[:at], parent=parent)
        self.nodes[upper.id] = upper
        cut = at // ps
        for t in range(3):
            pages = node.pages[t]
            if pages is not None:
                upper.pages[t], node.pages[t] = pages[:cut], pages[cut:]
                upper.tier_children[t] = 1
            upper.refs[t] = node.refs[t]
            upper.stamp[t] = node.stamp[t]
        upper.hits = node.hits
        if node.keys is not None:
            upper.keys, node.keys = node.keys[:cut], node.keys[cut:]
        for d in range(4):
            transfer = node.inflight[d]
            pending = node.pending[d]
            if transfer is not None and pending is not None:
                upper.inflight[d] = transfer
                upper.pending[d], node.pending[d] = pending[:cut], pending[cut:]
                transfer.nodes.insert(transfer.nodes.index(node), upper)
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        parent.children[upper.key[:ps]] = upper
        return upper

    def remove(self, node: Node) -> None:
        """Unlink an EMPTY leaf (no copy, nothing in flight, no children)."""
        before = self.expect(node, Event.REMOVE)
        if node.children:
            raise IntegrityError("structure", repr(node), "removing a node that has children")
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[: self.page_size]]
        del self.nodes[node.id]
        node.alive = False
        node.parent = None
        self.record(node, RunState.EMPTY, Event.REMOVE, before)

    def publish(self, node: Node, tier: Tier, pages: list[int]) -> None:
        """Make ``pages`` the node's copy in ``tier`` (spec checks are the caller's)."""
        t = tier.value
        node.pages[t] = pages
        node.stamp[t] = next(self._clock)
        parent = node.parent
        assert parent is not None
        parent.tier_children[t] += 1
        if node.refs[t]:
            self.protected[t] += len(pages)
        else:
            self.evictable[t] += len(pages)
        self.push_candidate(node, tier)

    def drop(self, node: Node, tier: Tier) -> list[int]:
        """Clear the node's copy in ``tier``; returns the pages (the caller frees them)."""
        t = tier.value
        pages = node.pages[t]
        assert pages is not None
        node.pages[t] = None
        node.version[t] += 1
        self.evictable[t] -= len(pages)
        parent = node.parent
        assert parent is not None
        parent.tier_children[t] -= 1
        if parent.parent is not None:
            self.push_candidate(parent, tier)
        return pages

    # -- eviction index --------------------------------------------------------------------

    def allows(self, node: Node, event: Event) -> bool:
        """Whether the spec accepts ``event`` on ``node``'s run now."""
        state = node.state
        return state is not None and step(state, event) is not None

    def touch(self, node: Node, tier: Tier) -> None:
        """Mark ``node``'s copy in ``tier`` as just used (LRU)."""
        node.stamp[tier] = next(self._clock)
        self.push_candidate(node, tier)

    def is_evictable(self, node: Node, tier: Tier) -> bool:
        """Unlocked, a leaf in ``tier``, and the spec allows dropping that copy."""
        t = tier.value
        if not node.alive or node.parent is None or node.pages[t] is None:
            return False
        if node.refs[t] or node.tier_children[t]:
            return False
        state = node.state
        return state is not None and step(state, evict_event(tier)) is not None

    def push_candidate(self, node: Node, tier: Tier) -> None:
        """Index ``node`` for eviction in ``tier`` if it is evictable now. Entries go stale
        (re-stamped or no longer evictable nodes stay until popped), so the index is rebuilt
        from the live nodes as soon as it holds more than 4 entries per node plus 64: memory
        stays linear in the tree whatever the access pattern."""
        if not self.is_evictable(node, tier):
            return
        heap = self._heaps[tier]
        heapq.heappush(heap, (node.stamp[tier], node.id, node))
        if len(heap) > 4 * len(self.nodes) + 64:
            self._rebuild(tier)

    def _rebuild(self, tier: Tier) -> None:
        heap = [(n.stamp[tier], n.id, n) for n in self.nodes.values() if self.is_evictable(n, tier)]
        heapq.heapify(heap)
        self._heaps[tier] = heap

    def pop_lru(self, tier: Tier) -> Node | None:
        """The least recently used evictable leaf in ``tier`` (removed from the index)."""
        heap = self._heaps[tier]
        while heap:
            stamp, _, node = heapq.heappop(heap)
            if node.stamp[tier] == stamp and self.is_evictable(node, tier):
                return node
        return None

    def peek_lru(self, tier: Tier) -> Node | None:
        """The least recently used evictable leaf in ``tier``, left in the index."""
        heap = self._heaps[tier]
        while heap:
            stamp, _, node = heap[0]
            if node.stamp[tier] == stamp and self.is_evictable(node, tier):
                return node
            heapq.heappop(heap)
        return None

    def index_entries(self, tier: Tier) -> set[tuple[int, int]]:
        """``(node id, stamp)`` pairs in the eviction index (for integrity checks)."""
        return {(n.id, stamp) for stamp, _, n in self._heaps[tier]}

    def iter_nodes(self) -> Iterator[Node]:
        return iter(self.nodes.values())
