"""HiRadixTree contracts: the walk counter, misuse and integrity errors, the eviction
index's memory bound, and a transfer start whose segment changes while making room."""

from __future__ import annotations

import pytest

from hicache.core import CacheCore, TierSizes
from hicache.core.tree import HiRadixTree
from hicache.errors import IntegrityError, MisuseError
from hicache.spec.model import Direction, Tier
from tests.core.test_tree import prefill


def test_the_walk_counter_starts_at_zero_and_counts_each_match() -> None:
    """A fresh tree has made no root-to-leaf walk; each match_prefixes adds exactly one."""
    tree = HiRadixTree(2)
    assert tree.walks == 0
    tree.match_prefixes((1, 2, 3, 4))
    tree.match_prefixes(())
    assert tree.walks == 2


@pytest.mark.parametrize("at", [0, 3, 4, 6])
def test_a_bad_split_point_is_misuse_naming_the_node_and_the_point(at: int) -> None:
    """split at 0, at the node's length or beyond, or off a page boundary raises
    MisuseError naming the node and the split point, and leaves the tree as it was."""
    core = CacheCore(2, TierSizes(8, 8, 8), tracing=True)
    node = prefill(core, (1, 2, 3, 4))
    before = core.snapshot()
    with pytest.raises(MisuseError) as info:
        core.tree.split(node, at)
    assert str(info.value) == f"cannot split {node!r} at {at}"
    assert core.snapshot() == before


def test_locking_a_path_without_that_tier_is_a_prefix_closure_error() -> None:
    """lock_node on a run with no copy in the tier raises IntegrityError('prefix-closure')
    whose ``where`` is the run and whose ``detail`` names the tier."""
    core = CacheCore(2, TierSizes(8, 8, 8), tracing=True)
    node = prefill(core, (1, 2, 3, 4))  # L1 only
    with pytest.raises(IntegrityError) as info:
        core.tree.lock_node(node, Tier.L2)
    assert info.value.invariant == "prefix-closure"
    assert info.value.where == repr(node)
    assert info.value.detail == "locking a path that lacks a L2 copy"


def test_the_eviction_index_never_holds_more_than_4_entries_per_node_plus_64() -> None:
    """The lazy eviction heap is compacted as soon as it exceeds 4 * len(nodes) + 64
    entries, so touching one run over and over keeps it within that bound."""
    core = CacheCore(2, TierSizes(8, 8, 8), tracing=True)
    node = prefill(core, (1, 2))
    tree = core.tree
    bound = 4 * len(tree.nodes) + 64
    sizes = []
    for _ in range(3 * bound):
        tree.touch(node, Tier.L1)
        sizes.append(len(tree._heaps[Tier.L1]))
    assert max(sizes) == bound  # reached, never exceeded
    assert tree.pop_lru(Tier.L1) is node


def test_start_refuses_when_making_room_changed_the_segment() -> None:
    """If make_room reshapes the segment (here an insert splits its run), start returns
    None and allocates nothing: the segment it checked is no longer the one to move."""
    core = CacheCore(2, TierSizes(16, 2, 16), tracing=True)
    other = prefill(core, (7, 8, 9, 10))
    x = core.start(Direction.D2H, other)
    assert x is not None
    core.complete(x)  # L2 now full
    node = prefill(core, (1, 2, 3, 4))

    def make_room(tier: Tier, n: int) -> bool:
        freed = core.evict(tier, n)
        prefill(core, (1, 2, 5, 6))  # splits node's run at 2
        return freed >= n

    assert core.start(Direction.D2H, node, make_room=make_room) is None
    assert core.l2.num_free == 2
    assert node.pages[Tier.L2] is None and not any(node.inflight)
    core.check_integrity()
