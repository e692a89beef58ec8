"""HiRadixTree and CacheCore: match, insert, split, locks, eviction, transfers."""

from __future__ import annotations

import pytest

from hicache.core import CacheCore, DevicePage, TierSizes
from hicache.core.node import Node
from hicache.errors import HandleError, MisuseError, PageOwnershipError, TransitionRefused
from hicache.spec.model import Direction, RunState, Tier


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
