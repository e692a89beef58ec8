"""``CacheCore``: the page-run lifecycle over the tree and the three allocators.

Engine-agnostic and I/O-free. It decides *what* may move and owns every page's bookkeeping;
a backend moves the bytes and reports back through :meth:`complete` / :meth:`fail` /
:meth:`cancel`. Each operation consults the spec table for every run it touches *before*
changing anything; a refused operation raises :class:`TransitionRefused` and changes nothing.

Ownership (invariant 1): every physical page of a tier is in exactly one of

    allocator free set | a node's published pages | a transfer's private dst | private L1

Lifecycle of a transfer (one whole path segment, top to bottom)::

    start(d, node)   segment = nodes on root..node lacking d.target   (a suffix of the path)
                     src lease: root..node in d.source; dst lease: root..segment parent in
                     d.target; dst pages allocated, private to the transfer
    complete(x)      publish dst on every node top-down, then release both leases
    fail/cancel(x)   free dst, release both leases; the runs are as before the start

Threading: one thread (the scheduler) calls into a ``CacheCore``; it is not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from hicache.core.allocator import PageAllocator
from hicache.core.geometry import DevicePage, HostPage, StorageSlot, TierSizes
from hicache.core.keys import page_keys
from hicache.core.node import Lease, Node, Transfer
from hicache.core.status import CoreStatus, TierStatus
from hicache.core.tokens import as_tokens, plain_int
from hicache.core.tree import HiRadixTree, MatchResult, TierMatch
from hicache.errors import ConfigError, HandleError, IntegrityError, MisuseError, PageOwnershipError, TransitionRefused
from hicache.spec.invariants import check_all
from hicache.spec.model import (
    Direction,
    Event,
    RunState,
    Tier,
    cancel_event,
    complete_event,
    evict_event,
    fail_event,
    start_event,
)
from hicache.spec.snapshot import LeaseView, NodeView, Snapshot, TransferView


@dataclass(frozen=True, slots=True)
class InsertResult:
    """Outcome of :meth:`CacheCore.insert`.

    ``length``: tokens of the prompt now held in L1 by the tree (page aligned).
    ``rejected``: private pages the tree did not adopt (duplicates of pages it already had,
    or pages past a run whose L1 copy is still being restored); they stay private, the
    caller frees them with :meth:`CacheCore.free_private` when done with them.
    ``node``: the deepest node covering ``length`` (the root if 0).
    ``pages``: the tree's L1 pages of ``[0, length)``, in token order.
    """

    length: int
    rejected: list[DevicePage]
    node: Node
    pages: list[DevicePage]


class CacheCore:
    """Lifecycle of page runs across L1/L2/L3. See the module docstring for the contract."""

    def __init__(self, page_size: int, sizes: TierSizes, *, tracing: bool = False) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ConfigError(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(sizes, TierSizes):
            raise ConfigError(f"sizes must be a TierSizes, got {sizes!r}")
        self.page_size = page_size
        self.sizes = sizes
        self.tree = HiRadixTree(page_size, tracing=tracing)
        self.l1: PageAllocator[DevicePage] = PageAllocator(sizes.l1_pages, "L1")
        self.l2: PageAllocator[HostPage] = PageAllocator(sizes.l2_pages, "L2")
        self.l3: PageAllocator[StorageSlot] = PageAllocator(sizes.l3_pages, "L3")
        self._alloc: tuple[PageAllocator[int], ...] = (self.l1, self.l2, self.l3)  # type: ignore[assignment]
        self.private: set[int] = set()
        self.transfers: dict[int, Transfer] = {}
        self._transfer_ids = 0
        self.evictions = [0, 0, 0]

    # -- private L1 pages ------------------------------------------------------------------

    def allocate_l1(self, n: int) -> list[DevicePage] | None:
        """``n`` private L1 pages for a request, or None if fewer are free (no eviction)."""
        pages = self.l1.allocate(n)
        if pages is None:
            return None
        self.private.update(pages)
        return pages

    def free_private(self, pages: Sequence[DevicePage]) -> None:
        """Give back private L1 pages (a finished or aborted request's own pages)."""
        ordered = sorted(pages)
        for p in ordered:
            if p not in self.private:
                raise PageOwnershipError(f"L1 page {p} is not a private page of a request")
        self.l1.check_allocated(ordered)
        for _ in ordered:
            self.tree.expect(None, Event.REMOVE)
        self.private.difference_update(ordered)
        self.l1.free(ordered)
        for _ in ordered:
            self.tree.record(None, RunState.L1_PRIVATE, Event.REMOVE, RunState.REMOVED)

    # -- match and lock ----------------------------------------------------------------------

    def match(self, tokens: object) -> MatchResult:
        """Per-tier page-aligned hit lengths for ``tokens``. Changes nothing."""
        return self.tree.match_prefixes(as_tokens(tokens))

    def match_valid(self, tokens: tuple[int, ...]) -> MatchResult:
        """:meth:`match` for tokens already validated by ``as_tokens`` (a request's own,
        matched several times per request: validation is an O(n) pass each time)."""
        return self.tree.match_prefixes(tokens)

    def lock(self, match: TierMatch) -> Lease:
        """Pin a match so its pages cannot be evicted (per tier; the whole path)."""
        return self.tree.lock(match)

    def release(self, lease: Lease) -> None:
        """Unpin. Double release or an unknown lease raises HandleError."""
        self.tree.release(lease)

    def pages(self, match: TierMatch) -> list[int]:
        """Physical pages of a match in token order (any tier)."""
        return self.tree.pages_of(match)

    def path_pages(self, node: Node | None, tier: Tier) -> list[int]:
        """The ``tier`` pages of the root..``node`` path in token order (all must be there)."""
        runs: list[list[int]] = []
        while node is not None and node.parent is not None:
            pages = node.pages[tier]
            if pages is None:
                raise IntegrityError("prefix-closure", repr(node), f"path lacks a {tier.name} copy")
            runs.append(pages)
            node = node.parent
        return [p for run in reversed(runs) for p in run]

    def pages_l1(self, match: TierMatch) -> list[DevicePage]:
        """The L1 pages of an L1 match in token order, typed."""
        if match.tier is not Tier.L1:
            raise MisuseError(f"pages_l1 needs an L1 match, got {match.tier.name}")
        # NOTE: DevicePage is a NewType (the identity at run time): no per-page call.
        return cast(list[DevicePage], self.tree.pages_of(match))

    # -- insert ----------------------------------------------------------------------------

    def insert(self, tokens: object, pages: Sequence[DevicePage]) -> InsertResult:
        """Hand a prefilled prompt's L1 pages to the tree.

        ``pages[i]`` holds tokens ``[i*ps, (i+1)*ps)``; only the page-aligned prefix of
        ``tokens`` is inserted and ``len(pages)`` must equal its page count. Each page is
        either the tree's own page at that position (a prefix the request matched) or one of
        the caller's private pages; anything else raises PageOwnershipError, changing nothing.

            tokens  [0 ............................. aligned) tail
            tree    [0 ...... matched) ...                          (shared pages)
            pages   [ tree's pages    | private pages        ]
                                        adopted, or rejected as duplicates
        """
        toks = as_tokens(tokens)
        ps = self.page_size
        aligned = len(toks) - len(toks) % ps
        # NOTE: types first, by type, not by equality: 0.0, False or np.float64(0) equal page 0
        # and would be published as ids the allocator refuses at eviction (pages then ownerless)
        given = [plain_int(p) for p in pages]  # numpy integers as the ints they hold
        odd = next((p for p in given if type(p) is not int), None)
        if odd is not None:
            raise PageOwnershipError(f"insert: page ids must be ints, got {odd!r} ({type(odd).__name__})")
        pages = cast(list[DevicePage], given)
        if len(pages) != aligned // ps:
            raise MisuseError(f"insert needs {aligned // ps} pages for {aligned} aligned tokens, got {len(pages)}")
        if len(set(pages)) != len(pages):
            raise PageOwnershipError("insert: a page is given twice")
        tree_pages = self._l1_pages_along(toks[:aligned])
        for i, p in enumerate(pages):
            if p != tree_pages[i] and p not in self.private:
                raise PageOwnershipError(
                    f"insert: page {p} at position {i} is neither the tree's page there nor a private page"
                )
        return self._insert(toks[:aligned], list(pages))

    def adopt(self, tokens: tuple[int, ...], pages: Sequence[DevicePage], prefix: int) -> InsertResult:
        """:meth:`insert` for a caller whose lease pins ``pages[:prefix]`` at their positions
        (the controller): one walk, no validation walk. ``pages[prefix:]`` must be private
        (checked); a pinned page found elsewhere than where the caller said is a bug."""
        ps = self.page_size
        aligned = len(tokens) - len(tokens) % ps
        if len(pages) != aligned // ps or not 0 <= prefix <= len(pages):
            raise MisuseError(f"adopt needs {aligned // ps} pages with a prefix in range, got {len(pages)}, {prefix}")
        own = pages[prefix:]
        if len(set(own)) != len(own) or not self.private.issuperset(own):
            raise PageOwnershipError("adopt: pages past the pinned prefix must be distinct private pages")
        return self._insert(tokens[:aligned], list(pages), pinned=prefix)

    def _l1_pages_along(self, toks: tuple[int, ...]) -> list[int | None]:
        """Read-only walk: the tree's L1 page at every page position of ``toks`` (or None)."""
        ps = self.page_size
        self.tree.walks += 1
        out: list[int | None] = []
        node = self.tree.root
        i = 0
        while i < len(toks):
            child = node.children.get(toks[i : i + ps])
            if child is None:
                break
            k = self.tree.common(child.key, toks, i)
            pages = child.pages[Tier.L1]
            out.extend(pages[: k // ps] if pages is not None else [None] * (k // ps))
            if k < len(child.key):
                break
            i += k
            node = child
        out.extend([None] * (len(toks) // ps - len(out)))
        return out

    def _insert(self, toks: tuple[int, ...], pages: list[int], pinned: int = 0) -> InsertResult:
        tree = self.tree
        ps = self.page_size
        tree.walks += 1
        node = tree.root
        rejected: list[int] = []
        held: list[int] = []  # the tree's L1 pages of [0, i)
        i = 0
        while i < len(toks):
            child = node.children.get(toks[i : i + ps])
            if child is None:
                new = tree.new_node(toks[i:], node)
                new_pages = pages[i // ps :]
                after = tree.expect(None, Event.INSERT)
                self.private.difference_update(new_pages)
                tree.publish(new, Tier.L1, new_pages)
                tree.record(new, RunState.L1_PRIVATE, Event.INSERT, after)
                held.extend(new_pages)
                node, i = new, len(toks)
                break
            k = tree.common(child.key, toks, i)
            if k < len(child.key):
                tree.split(child, k)
                child = node.children[toks[i : i + ps]]
            mine = pages[i // ps : (i + k) // ps]
            have = child.pages[Tier.L1]
            if have is not None:
                for j, (p, q) in enumerate(zip(mine, have, strict=True)):
                    if p != q:
                        if i // ps + j < pinned:
                            raise IntegrityError("pinning", repr(child), f"pinned page {p} found as {q}")
                        rejected.append(p)
                held.extend(have)
                tree.touch(child, Tier.L1)
            else:
                if i < pinned * ps:
                    raise IntegrityError("pinning", repr(child), "a pinned prefix lost its L1 copy")
                before = child.state
                if before is None or Event.INSERT not in _allowed(before):
                    rejected.extend(pages[i // ps :])
                    break
                after = tree.expect(child, Event.INSERT)
                self.private.difference_update(mine)
                tree.publish(child, Tier.L1, mine)
                tree.record(child, before, Event.INSERT, after)
                held.extend(mine)
            node = child
            i += k
        return InsertResult(i, rejected, node, held)  # type: ignore[arg-type]

    # -- transfers -------------------------------------------------------------------------

    def segment(self, direction: Direction, node: Node) -> list[Node]:
        """The nodes a transfer in ``direction`` ending at ``node`` would move, top down:
        the suffix of the root..node path lacking a ``direction.target`` copy."""
        target = direction.target
        out: list[Node] = []
        n = node
        while n.parent is not None and n.pages[target] is None:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    def can_start(self, direction: Direction, node: Node) -> bool:
        """Whether :meth:`start` would be accepted by the spec (ignoring free pages)."""
        seg = self.segment(direction, node) if node.alive else []
        if not seg or self._alloc[direction.target].capacity == 0:
            return False
        event = start_event(direction)
        return all((s := n.state) is not None and event in _allowed(s) for n in seg)

    def start(
        self, direction: Direction, node: Node, *, make_room: Callable[[Tier, int], bool] | None = None
    ) -> Transfer | None:
        """Begin moving the segment ending at ``node`` (see :meth:`segment`).

        Check, then commit: the source path and the destination's parent are pinned first,
        then ``make_room(target, n)`` (if given) may evict to free ``n`` pages — it can evict
        neither — then the destination pages are allocated. Returns None, changing nothing
        (beyond what ``make_room`` evicted), if the target tier still lacks free pages.
        Raises TransitionRefused, changing nothing, if the spec forbids it for any run of
        the segment, or the segment is empty.
        """
        if not node.alive or node.parent is None:
            raise HandleError(f"cannot start {direction.name} from {node!r}: not a live node")
        source, target = direction.source, direction.target
        if self._alloc[target].capacity == 0:
            raise TransitionRefused(f"{direction.name}: tier {target.name} has no capacity")
        seg = self.segment(direction, node)
        if not seg:
            raise TransitionRefused(f"{direction.name}: {node!r} already has a {target.name} copy")
        event = start_event(direction)
        for n in seg:
            self.tree.expect(n, event)
        need = sum(len(n.key) for n in seg) // self.page_size
        top_parent = seg[0].parent
        if top_parent is None:
            raise IntegrityError("structure", repr(seg[0]), "a segment node has no parent")
        src_lease = self.tree.lock_node(node, source, touch=False)
        dst_lease = None if top_parent.parent is None else self.tree.lock_node(top_parent, target, touch=False)
        alloc = self._alloc[target]
        dst: list[int] | None = None
        try:
            roomy = alloc.num_free >= need or (make_room is not None and make_room(target, need))
        except BaseException:
            # NOTE: making room may issue a victim's backup, and an interrupt there (a mover's
            # issue is not held) must not leave the pins just taken without a holder
            self.tree.release(src_lease)
            if dst_lease is not None:
                self.tree.release(dst_lease)
            raise
        # NOTE: the pins kept the segment (its parent keeps its target copy, its nodes their
        # source copy); re-derive it anyway: making room may run other transfers.
        if roomy and self.segment(direction, node) == seg and all(self.tree.allows(n, event) for n in seg):
            dst = alloc.allocate(need)
        if dst is None:
            self.tree.release(src_lease)
            if dst_lease is not None:
                self.tree.release(dst_lease)
            return None
        src: list[int] = []
        for n in seg:
            pages = n.pages[source]
            if pages is None:
                raise IntegrityError("declared-states", repr(n), f"{direction.name} source lacks {source.name}")
            src.extend(pages)
        self._transfer_ids += 1
        transfer = Transfer(
            self._transfer_ids,
            direction,
            list(seg),
            src,
            dst,
            src_lease,
            dst_lease,
            tokens=len(src) * self.page_size,
        )
        off = 0
        for n in seg:
            before = n.state
            after = self.tree.expect(n, event)
            width = len(n.key) // self.page_size
            n.inflight[direction] = transfer
            n.pending[direction] = dst[off : off + width]
            off += width
            if before is not None:
                self.tree.record(n, before, event, after)
        self.transfers[transfer.id] = transfer
        return transfer

    def _finish(self, transfer: Transfer, event: Event) -> list[tuple[Node, RunState, RunState]]:
        if transfer.done or self.transfers.get(transfer.id) is not transfer:
            raise HandleError(f"transfer #{transfer.id} already finished or unknown")
        plan = []
        for n in transfer.nodes:
            before = n.state
            assert before is not None
            plan.append((n, before, self.tree.expect(n, event)))
        return plan

    def _close(self, transfer: Transfer) -> None:
        transfer.done = True
        del self.transfers[transfer.id]
        self.tree.release(transfer.src_lease)
        if transfer.dst_lease is not None:
            self.tree.release(transfer.dst_lease)

    def complete(self, transfer: Transfer) -> None:
        """The backend finished copying: publish ``dst`` on every run, top down, then unlock."""
        d = transfer.direction
        event = complete_event(d)
        plan = self._finish(transfer, event)
        for n, before, after in plan:
            pending = n.pending[d]
            assert pending is not None
            n.inflight[d] = None
            n.pending[d] = None
            self.tree.publish(n, d.target, pending)
            self.tree.record(n, before, event, after)
        self._close(transfer)

    def fail(self, transfer: Transfer) -> None:
        """The transfer failed: its private pages go back, the runs are as before start."""
        self._abandon(transfer, fail_event(transfer.direction))

    def cancel(self, transfer: Transfer) -> None:
        """Cancelled (abort/close). Call only once the backend no longer touches ``dst``."""
        self._abandon(transfer, cancel_event(transfer.direction))

    def _abandon(self, transfer: Transfer, event: Event) -> None:
        d = transfer.direction
        plan = self._finish(transfer, event)
        for n, before, after in plan:
            n.inflight[d] = None
            n.pending[d] = None
            self.tree.record(n, before, event, after)
        self._alloc[d.target].free(transfer.dst)
        self._close(transfer)

    # -- eviction --------------------------------------------------------------------------

    def can_make_room(self, tier: Tier, n: int) -> bool:
        """Whether free plus evictable pages of ``tier`` reach ``n``."""
        return self._alloc[tier].num_free + self.tree.evictable[tier] >= n

    def evict(self, tier: Tier, num_pages: int) -> int:
        """Drop LRU unlocked leaf copies in ``tier`` until ``num_pages`` are freed or none is
        left; returns pages freed. Only that tier's copy goes; a node with no copy left and
        nothing in flight is removed from the tree."""
        freed = 0
        while freed < num_pages:
            node = self.tree.pop_lru(tier)
            if node is None:
                break
            freed += self._evict_one(node, tier)
        return freed

    def evict_node(self, node: Node, tier: Tier) -> int:
        """Drop exactly ``node``'s copy in ``tier``; returns pages freed. Raises
        TransitionRefused, changing nothing, unless that copy is evictable (present,
        unpinned, a leaf in ``tier``, not a transfer source)."""
        if not self.tree.is_evictable(node, tier):
            raise TransitionRefused(f"cannot evict the {tier.name} copy of {node!r}")
        return self._evict_one(node, tier)

    def lru_victim(self, tier: Tier) -> Node | None:
        """The run :meth:`evict` would drop next in ``tier`` (nothing changes)."""
        return self.tree.peek_lru(tier)

    def _evict_one(self, node: Node, tier: Tier) -> int:
        before = node.state
        if before is None:
            raise IntegrityError("declared-states", repr(node), "evicting a run in an undeclared state")
        event = evict_event(tier)
        after = self.tree.expect(node, event)
        pages = self.tree.drop(node, tier)
        self._alloc[tier].free(pages)
        self.tree.record(node, before, event, after)
        self.evictions[tier] += len(pages)
        if after is RunState.EMPTY:
            self.tree.remove(node)
        return len(pages)

    # -- a shared L3: what the store holds behind our back ---------------------------------------

    def page_keys(self, node: Node, seed: bytes) -> list[bytes]:
        """The content keys of ``node``'s pages (:mod:`hicache.core.keys`), computed once per
        run from its parent's last key and kept on the run (a split divides them)."""
        path: list[Node] = []
        n: Node | None = node
        while n is not None and n.parent is not None and n.keys is None:
            path.append(n)
            n = n.parent
        parent = seed if n is None or n.parent is None else n.keys[-1]  # type: ignore[index]
        for m in reversed(path):
            m.keys = page_keys(parent, m.key, self.page_size)
            parent = m.keys[-1]
        return node.keys or []

    def discover(self, tokens: tuple[int, ...], pages: int, keys: Sequence[bytes] | None = None) -> TierMatch:
        """Record that a shared store holds the first ``pages`` pages of ``tokens``: each run
        on that path without an L3 copy gets one (fresh L3 slots; a ``discover`` each), and
        the part past the tree becomes a new run known only in L3. Stops, keeping what it
        recorded, at a run that refuses (an H2S in flight) or where L3 has no room. ``keys``
        (the pages' content keys) are kept on the runs. Returns the L3 match of the path.

            tokens  [0 ........................ pages*ps) ...
            tree    [L3 | no L3 (discovered) | ... ]  [new run, REMOTE -> L3]
        """
        tree, ps = self.tree, self.page_size
        limit = min(pages * ps, len(tokens) - len(tokens) % ps)
        tree.walks += 1
        node, i = tree.root, 0
        targets: list[tuple[Node, int]] = []  # runs without L3 on the path, and where they start
        deepest_l3: Node | None = None
        while i < limit:
            child = node.children.get(tokens[i : i + ps])
            if child is None:
                break
            k = min(tree.common(child.key, tokens, i), limit - i)
            if child.pages[Tier.L3] is None and not tree.allows(child, Event.DISCOVER):
                limit = i  # a backup to L3 is in flight there: the rest waits for it
                break
            if k < len(child.key) and (child.pages[Tier.L3] is None or i + k < limit):
                tree.split(child, k)
                child = node.children[tokens[i : i + ps]]
            if child.pages[Tier.L3] is None:
                targets.append((child, i))
            elif not targets:
                deepest_l3 = child
            node, i = child, i + k
        tail = (node, i) if i < limit else None
        need = sum(len(n.key) for n, _ in targets) // ps + (0 if tail is None else (limit - i) // ps)
        if need and self.l3.num_free < need:
            pin = None if deepest_l3 is None else tree.lock_node(deepest_l3, Tier.L3)
            try:
                self.ensure_free(Tier.L3, need)
            finally:
                if pin is not None:
                    tree.release(pin)
        if need and self.l3.num_free < need:  # no room: record nothing past what L3 holds
            return self._l3_match(deepest_l3, limit)
        slots: list[int] = list(self.l3.allocate(need) or [])
        last = deepest_l3
        at = 0
        for n, start in targets:
            width = len(n.key) // ps
            before = n.state
            after = tree.expect(n, Event.DISCOVER)
            tree.publish(n, Tier.L3, slots[at : at + width])
            if keys is not None and n.keys is None and len(keys) >= (start // ps) + width:
                n.keys = list(keys[start // ps : start // ps + width])
            if before is not None:
                tree.record(n, before, Event.DISCOVER, after)
            at += width
            last = n
        if tail is not None:
            parent, start = tail
            new = tree.new_node(tokens[start:limit], parent)
            after = tree.expect_from(RunState.REMOTE, Event.DISCOVER)
            tree.publish(new, Tier.L3, slots[at:])
            if keys is not None and len(keys) >= limit // ps:
                new.keys = list(keys[start // ps : limit // ps])
            tree.record(new, RunState.REMOTE, Event.DISCOVER, after)
            last = new
        return self._l3_match(last, limit)

    def _l3_match(self, node: Node | None, limit: int) -> TierMatch:
        """The L3 match ending at ``node`` (the deepest run of the path with an L3 copy),
        at most ``limit`` tokens long."""
        if node is None:
            return TierMatch(Tier.L3, 0, self.tree.root, 0)
        return TierMatch(Tier.L3, min(self.tree.depth_tokens(node), limit), node, node.version[Tier.L3])

    def _l3_below(self, node: Node) -> list[Node]:
        runs: list[Node] = []
        stack = [node]
        while stack:
            n = stack.pop()
            if n.pages[Tier.L3] is not None:
                runs.append(n)
                stack.extend(n.children.values())
        return runs

    def can_lose(self, node: Node) -> bool:
        """Whether :meth:`lose` would be accepted now (changes nothing)."""
        if not node.alive or node.pages[Tier.L3] is None:
            return False
        return all(not n.refs[Tier.L3] and self.tree.allows(n, Event.LOSE) for n in self._l3_below(node))

    def lose(self, node: Node) -> int:
        """Forget the L3 copies of ``node`` and every run below it (a shared store no longer
        has them; what is below a lost page is unreachable). Returns the L3 slots freed.
        Raises TransitionRefused, changing nothing, if any of them is pinned in L3 or read."""
        if not self.can_lose(node):
            raise TransitionRefused(f"cannot lose the L3 copy of {node!r}: none, pinned, in L2 or being moved")
        runs = self._l3_below(node)
        freed = 0
        for n in reversed(runs):  # deepest first: a parent is removable once its children are
            before = n.state
            assert before is not None
            after = self.tree.expect(n, Event.LOSE)
            pages = self.tree.drop(n, Tier.L3)
            self._alloc[Tier.L3].free(pages)
            self.tree.record(n, before, Event.LOSE, after)
            freed += len(pages)
            if after is RunState.EMPTY and not n.children:
                self.tree.remove(n)
        return freed

    def trim(self, match: TierMatch) -> TierMatch:
        """The same match on a node that ends exactly at ``match.length``, splitting the
        node the match ends inside (so a transfer from it moves exactly that prefix).
        Raises HandleError if the match's copy was dropped since."""
        tree = self.tree
        tree.check_fresh(match.node, match.tier, match.version)
        node = match.node
        if node.parent is None:
            return match
        start = tree.depth_tokens(node) - len(node.key)
        while start >= match.length and node.parent is not None and node.parent.parent is not None:
            node = node.parent  # a split since the match moved its end into an upper half
            start -= len(node.key)
        cut = match.length - start
        if node is match.node and cut == len(node.key):
            return match
        if cut < len(node.key):
            node = tree.split(node, cut)
        return TierMatch(match.tier, match.length, node, node.version[match.tier])

    def ensure_free(self, tier: Tier, n: int) -> bool:
        """Evict in ``tier`` until ``n`` pages are free; False (having evicted nothing) if
        that is impossible."""
        alloc = self._alloc[tier]
        if alloc.num_free >= n:
            return True
        if not self.can_make_room(tier, n):
            return False
        self.evict(tier, n - alloc.num_free)
        if alloc.num_free < n:
            raise IntegrityError(
                "pinning", f"tier {tier.name}", "evictable counter promised more pages than eviction found"
            )
        return True

    # -- observability ---------------------------------------------------------------------

    def status(self) -> CoreStatus:
        """Per-tier capacity, free, protected, evictable, in-flight and private pages."""
        in_flight = [0, 0, 0]
        per_dir = [0, 0, 0, 0]
        for x in self.transfers.values():
            in_flight[x.direction.target] += len(x.dst)
            per_dir[x.direction] += 1
        tiers = [
            TierStatus(
                tier=t.name,
                capacity=self._alloc[t].capacity,
                free=self._alloc[t].num_free,
                protected=self.tree.protected[t],
                evictable=self.tree.evictable[t],
                in_flight=in_flight[t],
                private=len(self.private) if t is Tier.L1 else 0,
                evicted=self.evictions[t],
            )
            for t in Tier
        ]
        return CoreStatus(
            page_size=self.page_size,
            tiers=tiers,
            transfers_in_flight={d.name: per_dir[d] for d in Direction},
            nodes=len(self.tree.nodes) - 1,
            leases=len(self.tree.leases),
        )

    def snapshot(self) -> Snapshot:
        """A plain-data view of everything the invariants look at."""
        tree = self.tree
        nodes = {
            n.id: NodeView(
                id=n.id,
                parent=None if n.parent is None else n.parent.id,
                key=n.key,
                children=tuple((k, c.id) for k, c in n.children.items()),
                pages=tuple(None if p is None else tuple(p) for p in n.pages),
                refs=tuple(n.refs),
                stamp=tuple(n.stamp),
                tier_children=tuple(n.tier_children),
                inflight=tuple(None if x is None else x.id for x in n.inflight),
                pending=tuple(None if p is None else tuple(p) for p in n.pending),
                alive=n.alive,
            )
            for n in tree.nodes.values()
        }
        transfers = {
            x.id: TransferView(
                id=x.id,
                direction=x.direction,
                nodes=tuple(n.id for n in x.nodes),
                src=tuple(x.src),
                dst=tuple(x.dst),
                src_lease=x.src_lease.id,
                dst_lease=None if x.dst_lease is None else x.dst_lease.id,
            )
            for x in self.transfers.values()
        }
        leases = {
            lease.id: LeaseView(lease.id, lease.tier, lease.node.id, lease.node.alive, lease.length)
            for lease in tree.leases.values()
        }
        return Snapshot(
            page_size=self.page_size,
            capacity=tuple(a.capacity for a in self._alloc),
            free=tuple(tuple(a.free_pages()) for a in self._alloc),
            private=tuple(sorted(self.private)),
            root=tree.root.id,
            nodes=nodes,
            transfers=transfers,
            leases=leases,
            protected=tuple(tree.protected),
            evictable=tuple(tree.evictable),
            index=tuple(frozenset(tree.index_entries(t)) for t in Tier),
        )

    def check_integrity(self) -> None:
        """Verify invariants 1, 2, 4, 5, 6, 7 and 8; raise IntegrityError naming the first
        broken one and where. O(nodes + pages)."""
        violations = check_all(self.snapshot())
        if violations:
            v = violations[0]
            raise IntegrityError(v.invariant, v.where, v.detail)


def _allowed(state: RunState) -> frozenset[Event]:
    return _ALLOWED[state]


def _build_allowed() -> dict[RunState, frozenset[Event]]:
    from hicache.spec.model import TABLE

    out: dict[RunState, set[Event]] = {s: set() for s in RunState}
    for s, e in TABLE:
        out[s].add(e)
    return {s: frozenset(v) for s, v in out.items()}


_ALLOWED = _build_allowed()
