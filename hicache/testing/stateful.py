"""A hypothesis ``RuleBasedStateMachine`` for the core, shipped for embedders.

It drives the real :class:`CacheCore` (tree + lifecycle) with a :class:`FakeBackend` whose
transfers complete, fail or are cancelled in any order, and compares it after every step
with a reference model that knows only sets of page-aligned prefixes:

    model.resident[t]   prefixes whose last page is published in tier t
    model.locks[t]      prefixes pinned by leases (requests, explicit locks, transfers)
    model.flights       in-flight transfers: direction and the prefixes they cover

Checked after every step: ``check_integrity()``; the real tree's resident prefixes equal
the model's, per tier; every published page carries the content tag of its prefix (so a
page published before its transfer completed, or misrouted by a split, is caught).
Eviction is checked for legality (only unlocked leaves, never a transfer source) and
progress rather than for the exact LRU victim.

Subclass to change the configuration (``page_size``, ``sizes``, ``alphabet``,
``max_pages``). ``coverage`` accumulates the spec transitions exercised over all runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

from hypothesis import note, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.core.cache import CacheCore
from hicache.core.geometry import DevicePage, TierSizes
from hicache.core.node import Lease, Node, Transfer
from hicache.errors import HandleError, MisuseError, TransitionRefused
from hicache.spec.model import Direction, Event, RunState, Tier
from hicache.testing.fake_backend import FakeBackend, page_tag

Prefix = tuple[int, ...]


@dataclass
class Model:
    resident: list[set[Prefix]] = field(default_factory=lambda: [set(), set(), set()])
    locks: list[Counter[Prefix]] = field(default_factory=lambda: [Counter(), Counter(), Counter()])
    flights: dict[int, tuple[Direction, list[Prefix]]] = field(default_factory=dict)

    def match(self, prompt: Prefix, ps: int, tier: Tier) -> int:
        n = 0
        while n + ps <= len(prompt) and prompt[: n + ps] in self.resident[tier]:
            n += ps
        return n

    def in_flight(self, prefix: Prefix, d: Direction) -> bool:
        return any(fd is d and prefix in ps for fd, ps in self.flights.values())

    def is_source(self, prefix: Prefix, tier: Tier) -> bool:
        return any(fd.source is tier and prefix in ps for fd, ps in self.flights.values())


@dataclass
class Request:
    prompt: Prefix
    lease: Lease | None
    shared: list[DevicePage]
    private: list[DevicePage]
    lock_prefixes: list[Prefix]


def resident_prefixes(core: CacheCore) -> list[set[Prefix]]:
    """Every page-aligned prefix whose last page is published, per tier (one DFS)."""
    ps = core.page_size
    out: list[set[Prefix]] = [set(), set(), set()]
    stack: list[tuple[Node, Prefix]] = [(c, ()) for c in core.tree.root.children.values()]
    while stack:
        node, above = stack.pop()
        full = above + node.key
        for t in Tier:
            if node.pages[t] is not None:
                for k in range(len(above) + ps, len(full) + 1, ps):
                    out[t].add(full[:k])
        stack.extend((c, full) for c in node.children.values())
    return out


def path_prefixes(core: CacheCore, node: Node) -> list[Prefix]:
    """The page-aligned prefixes covered by the root..node path."""
    toks = core.tree.tokens_of(node)
    return [toks[:k] for k in range(core.page_size, len(toks) + 1, core.page_size)]


def node_prefixes(core: CacheCore, nodes: list[Node]) -> list[Prefix]:
    out: list[Prefix] = []
    for n in nodes:
        toks = core.tree.tokens_of(n)
        start = len(toks) - len(n.key)
        out.extend(toks[:k] for k in range(start + core.page_size, len(toks) + 1, core.page_size))
    return out


RECIPES: dict[str, list[tuple[str, str]]] = {
    # How to bring a freshly inserted run (state L1) into each declared state:
    # ("write", D) transfer and complete at once, ("fly", D) leave it in flight,
    # ("drop", T) evict everything evictable in tier T.
    "L1": [],
    "D2H_PENDING": [("fly", "D2H")],
    "L1_L2": [("write", "D2H")],
    "H2S_PENDING": [("write", "D2H"), ("fly", "H2S")],
    "L1_L2_L3": [("write", "D2H"), ("write", "H2S")],
    "L2": [("write", "D2H"), ("drop", "L1")],
    "H2D_PENDING": [("write", "D2H"), ("drop", "L1"), ("fly", "H2D")],
    "L3": [("write", "D2H"), ("write", "H2S"), ("drop", "L1"), ("drop", "L2")],
    "S2H_PENDING": [("write", "D2H"), ("write", "H2S"), ("drop", "L1"), ("drop", "L2"), ("fly", "S2H")],
    "L2_L3": [("write", "D2H"), ("write", "H2S"), ("drop", "L1")],
    "L2__H2S": [("write", "D2H"), ("fly", "H2S"), ("drop", "L1")],
    "L2__H2S_H2D": [("write", "D2H"), ("fly", "H2S"), ("drop", "L1"), ("fly", "H2D")],
    "L1_L3": [("write", "D2H"), ("write", "H2S"), ("drop", "L2")],
    "L1_L3__D2H": [("write", "D2H"), ("write", "H2S"), ("drop", "L2"), ("fly", "D2H")],
    "L1_L3__S2H": [("write", "D2H"), ("write", "H2S"), ("drop", "L2"), ("fly", "S2H")],
    "L2_L3__H2D": [("write", "D2H"), ("write", "H2S"), ("drop", "L1"), ("fly", "H2D")],
}


class CoreStateMachine(RuleBasedStateMachine):
    page_size: ClassVar[int] = 2
    sizes: ClassVar[TierSizes] = TierSizes(l1_pages=6, l2_pages=6, l3_pages=8)
    alphabet: ClassVar[int] = 3
    max_pages: ClassVar[int] = 4
    coverage: ClassVar[Counter[tuple[RunState, Event]]] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.core = CacheCore(self.page_size, self.sizes, tracing=True)
        self.fake = FakeBackend(self.core)
        self.model = Model()
        self.prompts: list[Prefix] = []
        self.requests: list[Request] = []
        self.leases: list[tuple[Lease, list[Prefix]]] = []
        self.transfers: list[Transfer] = []
        self.pins: dict[int, list[tuple[Tier, list[Prefix]]]] = {}

    # -- helpers ---------------------------------------------------------------------------

    def _remember(self, prompt: Prefix) -> None:
        if prompt not in self.prompts:
            self.prompts.append(prompt)

    def _evict(self, tier: Tier, n: int) -> int:
        """Evict through the core and check the choice against the model."""
        model = self.model
        ps = self.page_size
        evictable = sum(1 for p in model.resident[tier] if not model.locks[tier][p] and not model.is_source(p, tier))
        freed = self.core.evict(tier, n)
        after = resident_prefixes(self.core)[tier]
        gone = model.resident[tier] - after
        note(f"evict {tier.name} {n}: freed {freed}, dropped {sorted(gone)}")
        assert after <= model.resident[tier], "eviction created residency"
        assert len(gone) == freed, "freed pages differ from dropped prefixes"
        for p in gone:
            assert not model.locks[tier][p], f"evicted locked {p}"
            assert not model.is_source(p, tier), f"evicted a transfer source {p}"
        for p in after:
            assert len(p) == ps or p[:-ps] in after, f"eviction broke prefix closure at {p}"
        assert freed >= min(n, evictable), f"evicted {freed} of {n} with {evictable} evictable"
        model.resident[tier] = after
        return freed

    def _lock(self, prefixes: list[Prefix], tier: Tier, delta: int) -> None:
        for p in prefixes:
            self.model.locks[tier][p] += delta
        self.model.locks[tier] += Counter()  # drop zero counts

    # -- seeding ---------------------------------------------------------------------------

    @initialize(
        seeds=st.lists(
            st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6), st.sampled_from(sorted(RECIPES))),
            min_size=1,
            max_size=2,
        ),
        late=st.lists(st.integers(0, 31), max_size=2),
    )
    def seed(self, seeds: list[tuple[list[int], str]], late: list[int]) -> None:
        """Start from prompts brought into drawn spec states (see RECIPES) through the
        public operations, then maybe open requests while their transfers are in flight."""
        for tokens, recipe in seeds:
            self.prefill(tokens)
            if not self.requests:
                continue
            prompt = self.requests[-1].prompt
            self.finish(len(self.requests) - 1, foreign=False)
            for op, arg in RECIPES[recipe]:
                if op == "drop":
                    self._evict(Tier[arg], 1000)
                else:
                    self._start(prompt, Direction[arg], make_room=True, at_once=op == "write")
        for i in late:
            if self.prompts:
                self.prefill(list(self.prompts[i % len(self.prompts)]))

    # -- requests --------------------------------------------------------------------------

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=16))
    def prefill(self, tokens: list[int]) -> None:
        """A request arrives, locks its L1 hit, and computes the rest into private pages."""
        ps = self.page_size
        prompt = tuple(t % self.alphabet for t in tokens[: self.max_pages * ps])
        self._remember(prompt)
        hit = self.core.match(prompt)
        assert hit.l1.length == self.model.match(prompt, ps, Tier.L1)
        need = len(prompt) // ps - hit.l1.length // ps
        lease = self.core.lock(hit.l1) if hit.l1.length else None
        locked = path_prefixes(self.core, hit.l1.node) if lease else []
        self._lock(locked, Tier.L1, +1)
        if self.core.l1.num_free < need and self.core.can_make_room(Tier.L1, need):
            self._evict(Tier.L1, need - self.core.l1.num_free)
        pages = self.core.allocate_l1(need)
        if pages is None:
            note(f"prefill {prompt}: no room for {need} pages")
            if lease:
                self.core.release(lease)
                self._lock(locked, Tier.L1, -1)
            return
        shared = self.core.pages_l1(hit.l1)
        assert self.fake.tags(Tier.L1, shared) == self.fake.expected_tags(prompt, hit.l1.length)
        self.fake.prefill(prompt, len(shared), pages)
        self.requests.append(Request(prompt, lease, shared, pages, locked))
        note(f"prefill {prompt}: hit {hit.lengths}, {need} private pages")

    def _end(self, req: Request) -> None:
        if req.lease is not None:
            self.core.release(req.lease)
            self._lock(req.lock_prefixes, Tier.L1, -1)

    def _has_requests(self) -> bool:
        return bool(self.requests)

    @precondition(_has_requests)
    @rule(i=st.integers(0, 7), foreign=st.sampled_from([False, False, False, True]))
    def finish(self, i: int, foreign: bool) -> None:
        """Insert the request's pages into the tree (the model predicts what is adopted).
        ``foreign``: first try with a page the caller does not own (must raise, change nothing)."""
        if foreign:
            self.insert_foreign_page(i)
        req = self.requests.pop(i % len(self.requests))
        ps = self.page_size
        model = self.model
        prompt = req.prompt
        aligned = len(prompt) - len(prompt) % ps
        pages = [*req.shared, *req.private]
        expect_len = aligned
        for k in range(ps, aligned + 1, ps):
            p = prompt[:k]
            if p not in model.resident[Tier.L1] and model.in_flight(p, Direction.H2D):
                expect_len = k - ps
                break
        expect_rejected = [
            pages[k // ps - 1]
            for k in range(ps, aligned + 1, ps)
            if pages[k // ps - 1] in req.private and (k > expect_len or prompt[:k] in model.resident[Tier.L1])
        ]
        result = self.core.insert(prompt, pages)
        note(f"finish {prompt}: inserted {result.length}, rejected {result.rejected}")
        assert result.length == expect_len
        assert sorted(result.rejected) == sorted(expect_rejected)
        for k in range(ps, expect_len + 1, ps):
            model.resident[Tier.L1].add(prompt[:k])
        self.core.free_private(result.rejected)
        self._end(req)

    @precondition(_has_requests)
    @rule(i=st.integers(0, 7))
    def abort(self, i: int) -> None:
        """Abort a running request: its private pages and its lock go back."""
        req = self.requests.pop(i % len(self.requests))
        note(f"abort {req.prompt}")
        self.core.free_private(req.private)
        self._end(req)

    # -- transfers -------------------------------------------------------------------------

    def _has_prompts(self) -> bool:
        return bool(self.prompts)

    @precondition(_has_prompts)
    @rule(
        i=st.integers(0, 31),
        direction=st.sampled_from(Direction),
        make_room=st.booleans(),
        at_once=st.sampled_from([False, False, True]),
    )
    def start(self, i: int, direction: Direction, make_room: bool, at_once: bool) -> None:
        """Start a transfer ending at a prompt's deepest source copy, if the spec allows;
        ``at_once`` completes it immediately (reaching deep states in fewer steps)."""
        prompt = self.prompts[i % len(self.prompts)]
        hit = self.core.match(prompt)
        # Rotate to the first direction (from the drawn one) the spec allows here; a quarter
        # of the time (i odd-ish) keep any direction with a source, to exercise refusals.
        order = [Direction((direction + k) % 4) for k in range(4)]
        usable = [d for d in order if hit[d.source].length]
        legal = [d for d in usable if self.core.can_start(d, hit[d.source].node)]
        if not usable:
            return
        direction = legal[0] if legal and i % 4 else usable[0]
        self._start(prompt, direction, make_room, at_once)

    def _start(self, prompt: Prefix, direction: Direction, make_room: bool, at_once: bool) -> None:
        hit = self.core.match(prompt)
        src = hit[direction.source]
        if src.length == 0:
            return
        node = src.node
        seg = self.core.segment(direction, node)
        prefixes = node_prefixes(self.core, seg)
        model = self.model
        allowed = bool(prefixes) and self.core.sizes.capacities[direction.target] > 0
        for p in prefixes:
            assert p in model.resident[direction.source] and p not in model.resident[direction.target]
            if model.in_flight(p, direction):
                allowed = False
            if direction is Direction.D2H and model.in_flight(p, Direction.S2H):
                allowed = False
            if direction is Direction.S2H and model.in_flight(p, Direction.D2H):
                allowed = False
        assert self.core.can_start(direction, node) == allowed
        if not allowed:
            before = self.core.snapshot()
            try:
                self.core.start(direction, node)
            except TransitionRefused:
                pass
            else:
                raise AssertionError(f"{direction.name} on {node!r} was not refused")
            assert self.core.snapshot() == before, "a refused start changed the cache"
            return
        if make_room and self.core.can_make_room(direction.target, len(prefixes)):
            free = self.core._alloc[direction.target].num_free
            if free < len(prefixes):
                self._evict(direction.target, len(prefixes) - free)
                # eviction may have dropped the segment's target-tier parent path: recompute
                if not self.core.can_start(direction, node) or self.core.segment(direction, node) != seg:
                    return
        transfer = self.core.start(direction, node)
        if transfer is None:
            assert self.core._alloc[direction.target].num_free < len(prefixes)
            return
        self.fake.submit(transfer)
        note(f"start {direction.name} #{transfer.id} over {prefixes}")
        if at_once:
            self.fake.finish(transfer)
            model.resident[direction.target].update(prefixes)
            return
        # The transfer pins its source path and the target path above the segment.
        top = transfer.nodes[0].parent
        pins = [
            (direction.source, path_prefixes(self.core, transfer.nodes[-1])),
            (direction.target, [] if top is None else path_prefixes(self.core, top)),
        ]
        for tier, ps_ in pins:
            self._lock(ps_, tier, +1)
        model.flights[transfer.id] = (direction, prefixes)
        self.pins[transfer.id] = pins
        self.transfers.append(transfer)

    def _has_transfers(self) -> bool:
        return bool(self.transfers)

    @precondition(_has_transfers)
    @rule(i=st.integers(0, 7), outcome=st.sampled_from(["fail", "cancel", "complete"]))
    def finish_transfer(self, i: int, outcome: str) -> None:
        """Complete, fail or cancel any in-flight transfer, in any order."""
        transfer = self.transfers.pop(i % len(self.transfers))
        direction, prefixes = self.model.flights.pop(transfer.id)
        for tier, ps_ in self.pins.pop(transfer.id):
            self._lock(ps_, tier, -1)
        note(f"{outcome} {direction.name} #{transfer.id}")
        if outcome == "complete":
            self.fake.finish(transfer)
            self.model.resident[direction.target].update(prefixes)
        elif outcome == "fail":
            self.fake.finish(transfer, ok=False)
        else:
            self.fake.cancel(transfer)
        try:
            self.core.complete(transfer)
        except HandleError:
            pass
        else:
            raise AssertionError("a finished transfer was accepted again")

    # -- a shared store: runs discovered and lost behind the cache's back ---------------------

    @precondition(_has_prompts)
    @rule(i=st.integers(0, 31), pages=st.integers(1, 8))
    def discover(self, i: int, pages: int) -> None:
        """A shared store holds the first ``pages`` pages of a known prompt: the path gains L3
        copies (stopping at a run with an H2S in flight, or where L3 has no room)."""
        ps, model = self.page_size, self.model
        prompt = self.prompts[i % len(self.prompts)]
        n = min(pages, len(prompt) // ps)
        if n == 0:
            return
        stop = n * ps
        for k in range(ps, n * ps + 1, ps):
            if prompt[:k] not in model.resident[Tier.L3] and model.in_flight(prompt[:k], Direction.H2S):
                stop = k - ps
                break
        m = self.core.discover(prompt, n)
        note(f"discover {prompt[: n * ps]}: L3 now {m.length}")
        assert m.length <= stop
        real = resident_prefixes(self.core)[Tier.L3]
        gone = model.resident[Tier.L3] - real
        for p in gone:  # room made in L3 by eviction: legal victims only
            assert not model.locks[Tier.L3][p] and not model.is_source(p, Tier.L3), f"evicted {p}"
        path = {prompt[:k] for k in range(ps, m.length + 1, ps)}
        assert real - model.resident[Tier.L3] <= path, "discovery added residency off its path"
        assert path <= real
        for k in range(ps, m.length + 1, ps):  # the store's copy holds the prefix's content
            node = self.core.match(prompt[:k]).l3
            pages_ = self.core.pages(node)
            self.fake.content[Tier.L3][pages_[-1]] = page_tag(prompt[:k])
        model.resident[Tier.L3] = real

    @precondition(_has_prompts)
    @rule(i=st.integers(0, 31), at=st.integers(0, 3))
    def lose(self, i: int, at: int) -> None:
        """A read found a run gone from the store: it and everything below it lose their L3
        copy — refused (changing nothing) if any of them has L2, a transfer or an L3 pin."""
        ps, model = self.page_size, self.model
        prompt = self.prompts[i % len(self.prompts)]
        hit = self.core.match(prompt).l3
        if hit.length == 0:
            return
        path = self.core.tree.path(hit.node)
        node = path[at % len(path)]
        above = len(self.core.tree.tokens_of(node)) - len(node.key)
        head = self.core.tree.tokens_of(node)[: above + ps]
        below = {p for p in model.resident[Tier.L3] if len(p) > above and p[: above + ps] == head}
        allowed = all(
            p not in model.resident[Tier.L2]
            and not model.locks[Tier.L3][p]
            and not any(model.in_flight(p, d) for d in Direction)
            for p in below
        )
        note(f"lose {head}: {sorted(below)} allowed {allowed}")
        if not allowed:
            before = self.core.snapshot()
            try:
                self.core.lose(node)
            except TransitionRefused:
                pass
            else:
                raise AssertionError("lose was not refused")
            assert self.core.snapshot() == before, "a refused lose changed the cache"
            return
        assert self.core.lose(node) == len(below)
        model.resident[Tier.L3] -= below

    # -- eviction and locks ----------------------------------------------------------------

    @rule(tier=st.sampled_from(Tier), n=st.sampled_from([1, 2, 3, 1000]))
    def evict(self, tier: Tier, n: int) -> None:
        self._evict(tier, n)

    @precondition(_has_prompts)
    @rule(i=st.integers(0, 31), tier=st.sampled_from(Tier))
    def lock(self, i: int, tier: Tier) -> None:
        prompt = self.prompts[i % len(self.prompts)]
        m = self.core.match(prompt)[tier]
        if m.length == 0:
            return
        lease = self.core.lock(m)
        prefixes = path_prefixes(self.core, m.node)
        self._lock(prefixes, tier, +1)
        self.leases.append((lease, prefixes))

    def _has_leases(self) -> bool:
        return bool(self.leases)

    @precondition(_has_leases)
    @rule(i=st.integers(0, 7), again=st.booleans())
    def release(self, i: int, again: bool) -> None:
        """Release a lease; ``again``: then release it a second time (raises, changes nothing)."""
        lease, prefixes = self.leases.pop(i % len(self.leases))
        self.core.release(lease)
        self._lock(prefixes, lease.tier, -1)
        if again:
            self.release_twice(lease)

    def release_twice(self, lease: Lease) -> None:
        before = self.core.snapshot()
        try:
            self.core.release(lease)
        except HandleError:
            pass
        else:
            raise AssertionError("double release accepted")
        assert self.core.snapshot() == before

    @invariant()
    def matches_agree_with_model(self) -> None:
        """Per-tier match lengths equal the model's; matched pages carry the right tags."""
        for prompt in self.prompts:
            self._check_match(prompt)

    def _check_match(self, prompt: Prefix) -> None:
        hit = self.core.match(prompt)
        for t in Tier:
            assert hit[t].length == self.model.match(prompt, self.page_size, t), (t, hit.lengths)
            got = self.fake.tags(t, self.core.pages(hit[t]))
            assert got == self.fake.expected_tags(prompt, hit[t].length), f"{t.name} pages hold wrong content"

    def insert_foreign_page(self, i: int) -> None:
        """Inserting a page the caller does not own raises and changes nothing."""
        req = self.requests[i % len(self.requests)]
        if not req.private:
            return
        foreign = next(
            (
                p
                for p in range(self.core.sizes.l1_pages)
                if not self.core.l1.is_free(p) and p not in self.core.private and p not in req.shared
            ),
            None,
        )
        aligned = req.prompt[: len(req.prompt) - len(req.prompt) % self.page_size]
        if foreign is None or self.core._l1_pages_along(aligned)[len(req.shared)] == foreign:
            return  # that page would be legitimately the tree's own page at this position
        pages = [*req.shared, DevicePage(foreign), *req.private[1:]]
        before = self.core.snapshot()
        try:
            self.core.insert(req.prompt, pages)
        except MisuseError:
            pass
        else:
            raise AssertionError("insert adopted a foreign page")
        assert self.core.snapshot() == before

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.core.check_integrity()

    @invariant()
    def residency_matches_model(self) -> None:
        real = resident_prefixes(self.core)
        for t in Tier:
            assert real[t] == self.model.resident[t], (
                f"{t.name}: only real {sorted(real[t] - self.model.resident[t])}, "
                f"only model {sorted(self.model.resident[t] - real[t])}"
            )

    @invariant()
    def published_pages_hold_their_content(self) -> None:
        ps = self.page_size
        stack: list[tuple[Node, Prefix]] = [(c, ()) for c in self.core.tree.root.children.values()]
        while stack:
            node, above = stack.pop()
            full = above + node.key
            for t in Tier:
                pages = node.pages[t]
                if pages is None:
                    continue
                for j, page in enumerate(pages):
                    want = page_tag(full[: len(above) + (j + 1) * ps])
                    assert self.fake.content[t][page] == want, f"{t.name} page {page} of {node!r} holds wrong content"
            stack.extend((c, full) for c in node.children.values())

    def teardown(self) -> None:
        cls = type(self)
        # Steer generation towards runs that reach transitions seen least so far.
        rare = sum(1.0 / (1 + cls.coverage[k]) for k in self.core.tree.coverage)
        target(rare, label="rare spec transitions")
        cls.coverage.update(self.core.tree.coverage)
