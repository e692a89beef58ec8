"""HiRadixTree and CacheCore: match, insert, split, locks, eviction, transfers."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.core import CacheCore, DevicePage, TierSizes
from hicache.core.node import Node
from hicache.core.tree import HiRadixTree
from hicache.errors import HandleError, IntegrityError, MisuseError, PageOwnershipError, TransitionRefused
from hicache.spec.model import Direction, Event, RunState, Tier


def make(ps: int = 2, l1: int = 16, l2: int = 16, l3: int = 16) -> CacheCore:
    return CacheCore(ps, TierSizes(l1, l2, l3), tracing=True)


def prefill(core: CacheCore, prompt: tuple[int, ...]) -> Node:
    hit = core.match(prompt)
    have = hit.l1.length // core.page_size
    pages = core.allocate_l1(len(prompt) // core.page_size - have)
    assert pages is not None
    result = core.insert(prompt, core.pages_l1(hit.l1) + pages)
    core.free_private(result.rejected)
    core.check_integrity()
    return result.node


def through(core: CacheCore, node: Node, *dirs: Direction) -> None:
    for d in dirs:
        x = core.start(d, node)
        assert x is not None
        core.complete(x)
    core.check_integrity()


def test_match_is_page_aligned_and_changes_nothing() -> None:
    core = make(ps=4)
    prefill(core, tuple(range(10)))  # 8 tokens aligned
    before = core.snapshot()
    assert core.match((*range(7), 99)).lengths == (4, 0, 0)
    assert core.match(tuple(range(12))).lengths == (8, 0, 0)
    assert core.snapshot() == before


def test_insert_splits_and_shares_the_common_prefix() -> None:
    core = make()
    a = prefill(core, (1, 2, 3, 4, 5, 6))
    b = prefill(core, (1, 2, 3, 4, 7, 8))
    assert a.parent is b.parent and a.parent is not None
    assert a.parent.key == (1, 2, 3, 4)
    assert core.l1.num_free == 16 - 4


def test_split_carries_an_in_flight_transfer() -> None:
    """A D2H in flight over [1..6] survives a split at 4: both halves publish on complete."""
    core = make()
    node = prefill(core, (1, 2, 3, 4, 5, 6))
    x = core.start(Direction.D2H, node)
    assert x is not None
    prefill(core, (1, 2, 3, 4, 9, 9))
    assert len(x.nodes) == 2
    assert [n.state for n in x.nodes] == [RunState.D2H_PENDING, RunState.D2H_PENDING]
    core.check_integrity()
    core.complete(x)
    core.check_integrity()
    assert core.match((1, 2, 3, 4, 5, 6)).lengths == (6, 6, 0)
    assert core.match((1, 2, 3, 4, 9, 9)).lengths == (6, 4, 0)


def test_lock_protects_the_whole_path_and_double_release_raises() -> None:
    core = make()
    prefill(core, (1, 2, 3, 4))
    prefill(core, (1, 2, 5, 6))
    lease = core.lock(core.match((1, 2, 3, 4)).l1)
    assert core.evict(Tier.L1, 100) == 1  # only (5, 6) is unlocked
    assert core.match((1, 2, 3, 4)).l1.length == 4
    core.release(lease)
    with pytest.raises(HandleError, match="already released"):
        core.release(lease)
    assert core.evict(Tier.L1, 100) == 2
    core.check_integrity()


def test_stale_handle_raises() -> None:
    core = make()
    prefill(core, (1, 2, 3, 4))
    old = core.match((1, 2, 3, 4)).l1
    core.evict(Tier.L1, 100)
    with pytest.raises(HandleError, match="stale"):
        core.lock(old)
    with pytest.raises(HandleError, match="stale"):
        core.pages(old)


def test_eviction_is_lru_over_leaves() -> None:
    """The least recently used unlocked leaf is evicted first, whole."""
    core = make(ps=1)
    prefill(core, (1, 2))
    prefill(core, (3, 4))
    core.release(core.lock(core.match((1, 2)).l1))  # touch (1, 2): (3, 4) is now older
    assert core.evict(Tier.L1, 1) == 2  # a whole leaf run goes
    assert core.match((3, 4)).l1.length == 0
    assert core.match((1, 2)).l1.length == 2


def test_eviction_is_per_tier_and_node_removed_when_empty() -> None:
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    through(core, node, Direction.D2H)
    core.evict(Tier.L1, 100)
    assert node.alive and node.state is RunState.L2
    core.evict(Tier.L2, 100)
    assert node.id not in core.tree.nodes and len(core.tree.nodes) == 1
    core.check_integrity()


def test_restore_from_l3_publishes_l2_then_l1() -> None:
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    through(core, node, Direction.D2H, Direction.H2S)
    core.evict(Tier.L1, 100)
    core.evict(Tier.L2, 100)
    assert core.match((1, 2, 3, 4)).lengths == (0, 0, 4)
    through(core, core.match((1, 2, 3, 4)).l3.node, Direction.S2H, Direction.H2D)
    assert core.match((1, 2, 3, 4)).lengths == (4, 4, 4)


def test_failed_transfer_returns_private_pages_and_state() -> None:
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    x = core.start(Direction.D2H, node)
    assert x is not None and core.l2.num_free == 14
    core.fail(x)
    assert core.l2.num_free == 16 and node.state is RunState.L1
    with pytest.raises(HandleError):
        core.fail(x)
    core.check_integrity()


def test_refused_start_changes_nothing() -> None:
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    x = core.start(Direction.D2H, node)
    assert x is not None
    before = core.snapshot()
    with pytest.raises(TransitionRefused):
        core.start(Direction.D2H, node)  # already in flight
    with pytest.raises(TransitionRefused):
        core.start(Direction.H2D, node)  # already in L1
    assert core.snapshot() == before


def test_start_without_room_returns_none_and_changes_nothing() -> None:
    core = make(l2=1)
    node = prefill(core, (1, 2, 3, 4))
    before = core.snapshot()
    assert core.start(Direction.D2H, node) is None
    assert core.snapshot() == before


def test_insert_blocks_at_a_run_being_restored() -> None:
    """A run with H2D in flight cannot adopt the request's pages: insert stops before it
    and hands the rest back as rejected (still private)."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    through(core, node, Direction.D2H)
    core.evict(Tier.L1, 100)
    x = core.start(Direction.H2D, core.match((1, 2, 3, 4)).l2.node)
    assert x is not None
    pages = core.allocate_l1(3)
    assert pages is not None
    result = core.insert((1, 2, 3, 4, 5, 6), pages)
    assert result.length == 0 and sorted(result.rejected) == sorted(pages)
    core.check_integrity()
    core.free_private(result.rejected)
    core.complete(x)
    core.check_integrity()


def test_insert_rejects_pages_it_does_not_own() -> None:
    core = make()
    prefill(core, (1, 2, 3, 4))
    tree_pages = core.pages_l1(core.match((1, 2, 3, 4)).l1)
    before = core.snapshot()
    with pytest.raises(PageOwnershipError):
        core.insert((5, 6), [tree_pages[0]])  # a tree page at the wrong position
    with pytest.raises(PageOwnershipError):
        core.insert((5, 6), [DevicePage(15)])  # a free page nobody allocated
    with pytest.raises(MisuseError, match="needs 1 pages"):
        core.insert((5, 6, 7), [])
    assert core.snapshot() == before


@pytest.mark.parametrize("bad", [(), [1.5, 2.0], "ab", [[1, 2]]])
def test_bad_tokens_raise(bad: object) -> None:
    with pytest.raises(MisuseError, match="tokens"):
        make().match(bad)


def test_status_counts_pages() -> None:
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    lease = core.lock(core.match((1, 2)).l1)
    x = core.start(Direction.D2H, node)
    assert x is not None
    st = core.status()
    l1, l2, _ = st.tiers
    assert (l1.capacity, l1.free, l1.protected, l1.evictable) == (16, 14, 2, 0)
    assert (l2.free, l2.in_flight) == (14, 2)
    assert st.transfers_in_flight["D2H"] == 1
    core.complete(x)
    core.release(lease)
    assert core.status().tiers[0].evictable == 2
    assert core.status().to_dict()["tiers"][1]["evictable"] == 2


def test_eviction_stays_lru_after_the_index_is_rebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Touch leaves until the eviction heap's stale entries outgrow it and it is rebuilt
    (three times, at most once per 64 touches), then evict everything: exact LRU order."""
    rebuilds = [0]
    real_rebuild = HiRadixTree._rebuild

    def counting(self: HiRadixTree, tier: Tier) -> None:
        rebuilds[0] += 1
        real_rebuild(self, tier)

    monkeypatch.setattr(HiRadixTree, "_rebuild", counting)
    core = make(ps=1, l1=12)
    leaves = [(k,) for k in range(12)]
    for leaf in leaves:
        prefill(core, leaf)
    rng = random.Random(3)
    order = list(leaves)  # least recently used first
    touches = 0
    while rebuilds[0] < 3:
        leaf = rng.choice(leaves)
        core.release(core.lock(core.match(leaf).l1))  # each release indexes the leaf again
        touches += 1
        order.remove(leaf)
        order.append(leaf)
    assert touches >= 3 * 64
    assert len(core.tree._heaps[Tier.L1]) <= len(leaves)  # just rebuilt: no stale entries
    core.check_integrity()
    evicted = []
    for _ in leaves:
        before = {leaf for leaf in leaves if core.match(leaf).l1.length}
        assert core.evict(Tier.L1, 1) == 1
        evicted += [leaf for leaf in before if not core.match(leaf).l1.length]
    assert evicted == order


def test_ensure_free_succeeds_on_an_exact_fit() -> None:
    """Free plus evictable pages exactly equal to the request: it evicts just enough and
    reports success (no integrity error at the boundary)."""
    core = make(ps=1, l1=4)
    prefill(core, (1, 2))
    lease = core.lock(core.match((1, 2)).l1)
    prefill(core, (3,))
    assert (core.l1.num_free, core.tree.evictable[Tier.L1]) == (1, 1)
    assert core.can_make_room(Tier.L1, 2) and not core.can_make_room(Tier.L1, 3)
    assert not core.ensure_free(Tier.L1, 3)
    assert core.l1.num_free == 1  # refused: nothing was evicted
    assert core.ensure_free(Tier.L1, 2)
    assert core.l1.num_free == 2 and core.match((3,)).l1.length == 0
    assert core.match((1, 2)).l1.length == 2
    core.release(lease)
    core.check_integrity()


def test_a_tier_of_capacity_zero_never_starts_a_transfer() -> None:
    """With no L3 an L2 copy cannot start H2S: can_start says so and start refuses,
    changing nothing."""
    core = make(l3=0)
    node = prefill(core, (1, 2, 3, 4))
    through(core, node, Direction.D2H)
    assert core.can_start(Direction.D2H, node) is False  # already in L2
    assert not core.can_start(Direction.H2S, node)
    before = core.snapshot()
    with pytest.raises(TransitionRefused, match="no capacity"):
        core.start(Direction.H2S, node)
    assert core.snapshot() == before
    core.check_integrity()


def test_the_core_allows_exactly_the_events_of_the_table() -> None:
    """The core's per-state allowed events, rebuilt now, are TABLE's events of that state."""
    from hicache.core import cache
    from hicache.spec.model import TABLE

    rebuilt = cache._build_allowed()
    assert rebuilt == cache._ALLOWED
    assert rebuilt == {s: frozenset(e for (s2, e) in TABLE if s2 is s) for s in RunState}


def test_status_names_tiers_and_counts_private_and_evicted_pages() -> None:
    """Each tier row carries its name; private pages count in L1 only; evictions are
    counted per tier."""
    core = make()
    prefill(core, (1, 2, 3, 4))
    assert core.allocate_l1(3) is not None
    core.evict(Tier.L1, 100)
    st = core.status()
    assert [t.tier for t in st.tiers] == ["L1", "L2", "L3"]
    assert [t.private for t in st.tiers] == [3, 0, 0]
    assert [t.evicted for t in st.tiers] == [2, 0, 0]


def test_a_failed_transfer_is_traced_on_its_runs() -> None:
    """Tracing records a fail against the runs it touched, with the spec's states."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    x = core.start(Direction.D2H, node)
    assert x is not None
    core.fail(x)
    last = core.tree.trace[-1]
    assert (last.node, last.before, last.event, last.after) == (
        node.id,
        RunState.D2H_PENDING,
        Event.FAIL_D2H,
        RunState.L1,
    )


def test_a_lease_records_what_it_covers_and_its_release() -> None:
    """A lease from a match covers the match's length (here part of a node); one taken by
    a transfer covers the whole path; release marks it released."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    lease = core.lock(core.match((1, 2)).l1)
    assert (lease.tier, lease.node, lease.length) == (Tier.L1, node, 2)
    x = core.start(Direction.D2H, node)
    assert x is not None and x.src_lease.length == 4 and x.dst_lease is None
    core.release(lease)
    assert lease.released is True


def test_start_needs_a_live_node_below_the_root() -> None:
    """The root, or a node already removed, is a bad handle (HandleError), not a refusal."""
    core = make()
    node = prefill(core, (1, 2))
    with pytest.raises(HandleError):
        core.start(Direction.D2H, core.tree.root)
    core.evict(Tier.L1, 100)
    assert not node.alive
    with pytest.raises(HandleError):
        core.start(Direction.D2H, node)


def test_an_insert_onto_a_run_held_in_l2_is_traced_on_that_run() -> None:
    """Adopting a request's pages on a run that holds only L2 is traced against that run:
    L2 --insert--> L1_L2."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    through(core, node, Direction.D2H)
    core.evict(Tier.L1, 100)
    assert prefill(core, (1, 2, 3, 4)) is node
    last = core.tree.trace[-1]
    assert (last.node, last.before, last.event, last.after) == (node.id, RunState.L2, Event.INSERT, RunState.L1_L2)


def test_match_takes_an_array_like_a_tuple() -> None:
    """A 1-D integer array matches like the same tokens as a tuple; a 2-D one is misuse."""
    np = pytest.importorskip("numpy")
    core = make()
    prefill(core, (1, 2, 3, 4))
    assert core.match(np.array([1, 2, 3, 4, 5])).lengths == core.match((1, 2, 3, 4, 5)).lengths == (4, 0, 0)
    with pytest.raises(MisuseError, match="1-D"):
        core.match(np.array([[1, 2]]))


def test_freeing_private_pages_is_traced_as_removed() -> None:
    """Each private page given back is one trace entry: L1_PRIVATE --remove--> REMOVED, on
    no run."""
    core = make()
    pages = core.allocate_l1(2)
    assert pages is not None
    core.free_private(pages)
    assert [(e.node, e.before, e.event, e.after) for e in core.tree.trace[-2:]] == [
        (-1, RunState.L1_PRIVATE, Event.REMOVE, RunState.REMOVED)
    ] * 2


def test_adopting_a_pinned_prefix_that_has_no_l1_copy_is_an_integrity_error() -> None:
    """A caller that says it pins a prefix whose run holds no L1 copy (only L2) shows a
    pinning bug: IntegrityError naming the run."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    through(core, node, Direction.D2H)
    core.evict(Tier.L1, 100)
    assert node.pages[Tier.L1] is None and node.pages[Tier.L2] is not None
    pages = core.allocate_l1(2)
    assert pages is not None
    with pytest.raises(IntegrityError) as info:
        core.adopt((1, 2, 3, 4), pages, 1)
    err = info.value
    assert (err.invariant, err.where, err.detail) == ("pinning", repr(node), "a pinned prefix lost its L1 copy")


def test_ensure_free_raises_when_the_evictable_count_overstates_what_eviction_finds() -> None:
    """An evictable counter above what can really be evicted is a bug, reported for the
    tier, not a silent False."""
    core = make(l1=4)
    assert core.allocate_l1(2) is not None  # private: never evictable
    core.tree.evictable[Tier.L1] += 2  # two evictable pages that do not exist
    with pytest.raises(IntegrityError) as info:
        core.ensure_free(Tier.L1, 4)
    err = info.value
    assert (err.invariant, err.where, err.detail) == (
        "pinning",
        "tier L1",
        "evictable counter promised more pages than eviction found",
    )


@given(
    ps=st.sampled_from([1, 2, 16]),
    key_pages=st.integers(1, 40),
    start_pages=st.integers(0, 4),
    data=st.data(),
)
def test_common_is_the_longest_matching_run_of_whole_pages(
    ps: int, key_pages: int, start_pages: int, data: st.DataObject
) -> None:
    """``common`` against the page-by-page definition: the key's first page matches (it is
    the child's dict key), then whole pages as long as the tokens follow the key."""
    key = tuple(data.draw(st.lists(st.integers(0, 2), min_size=key_pages * ps, max_size=key_pages * ps)))
    shared = data.draw(st.integers(1, key_pages)) * ps
    rest = data.draw(st.lists(st.integers(0, 2), max_size=3 * ps))
    start = start_pages * ps
    tokens = (7,) * start + key[:shared] + tuple(rest)
    expected, n = ps, len(key)
    while expected < n and tokens[start + expected : start + expected + ps] == key[expected : expected + ps]:
        expected += ps
    if tokens[start : start + n] == key:
        expected = n
    assert HiRadixTree(ps).common(key, tokens, start) == expected
