"""Contracts of CacheCore and HiRadixTree that users rely on: matches, handles, discover,
status and snapshot views, tracing coverage and the errors that name their cause."""

from __future__ import annotations

from collections import Counter

import pytest

from hicache.core.tree import HiRadixTree, TierMatch
from hicache.errors import HandleError, IntegrityError, TransitionRefused
from hicache.spec.model import Direction, Event, Tier
from tests.core.test_tree import make, prefill, through


def test_match_follows_a_chain_of_three_runs_to_its_end() -> None:
    """A prompt matched across three nested runs gets the whole path, not a prefix of it."""
    core = make()
    prefill(core, (1, 2, 3, 4))
    prefill(core, (1, 2, 3, 4, 5, 6))
    leaf = prefill(core, (1, 2, 3, 4, 5, 6, 7, 8))
    assert len(core.tree.path(leaf)) == 3
    hit = core.match((1, 2, 3, 4, 5, 6, 7, 8, 9))
    assert hit.lengths == (8, 0, 0)
    assert hit.l1.node is leaf


def test_trim_keeps_the_length_and_ends_a_node_there() -> None:
    """Trimming a match that ends inside a run splits it; the trimmed handle covers the same
    tokens and pages as the original."""
    core = make()
    node = prefill(core, (1, 2, 3, 4, 5, 6))
    pages = list(node.pages[Tier.L1] or [])
    hit = core.match((1, 2, 3, 4, 9, 9))
    assert hit.l1.length == 4
    cut = core.trim(hit.l1)
    assert cut.length == 4
    assert cut.node.key == (1, 2, 3, 4)
    assert core.pages_l1(cut) == pages[:2]
    lease = core.lock(cut)
    assert lease.length == 4
    core.release(lease)
    core.check_integrity()


def test_discover_gives_an_l3_copy_to_runs_the_tree_already_holds() -> None:
    """A store found to hold a prompt the tree has only in L1 adds an L3 copy of that run."""
    core = make()
    node = prefill(core, (1, 2, 3, 4, 5, 6))
    got = core.discover((1, 2, 3, 4, 5, 6), 3)
    assert got.length == 6 and got.node is node
    assert core.match((1, 2, 3, 4, 5, 6)).lengths == (6, 0, 6)
    assert len(core.pages(got)) == 3
    assert core.l3.num_free == 16 - 3
    core.check_integrity()


def test_discover_without_room_in_l3_records_nothing() -> None:
    """With no L3 room, discover returns an empty L3 match at the root and changes nothing."""
    core = make(l3=0)
    prefill(core, (1, 2, 3, 4))
    before = core.snapshot()
    got = core.discover((1, 2, 3, 4, 5, 6), 3)
    assert (got.tier, got.length, got.node) == (Tier.L3, 0, core.tree.root)
    assert core.pages(got) == []
    assert core.snapshot() == before


def test_a_handle_on_a_tier_the_run_lacks_is_a_stale_handle() -> None:
    """A handle naming a tier in which the run holds no copy is refused with HandleError
    (the caller's mistake), not taken for a broken tree."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    forged = TierMatch(Tier.L2, 4, node, node.version[Tier.L2])
    before = core.snapshot()
    with pytest.raises(HandleError, match="L2 copy"):
        core.lock(forged)
    with pytest.raises(HandleError, match="L2 copy"):
        core.pages(forged)
    assert core.snapshot() == before


def test_status_sums_the_pages_of_all_transfers_into_a_tier() -> None:
    """Two backups to L2 in flight at once count all their destination pages."""
    core = make()
    a = prefill(core, (1, 2, 3, 4))
    b = prefill(core, (5, 6, 7, 8, 9, 10))
    xa = core.start(Direction.D2H, a)
    xb = core.start(Direction.D2H, b)
    assert xa is not None and xb is not None
    status = core.status()
    assert status.tiers[Tier.L2].in_flight == 2 + 3
    assert status.tiers[Tier.L1].in_flight == 0
    assert status.transfers_in_flight[Direction.D2H.name] == 2


def test_a_snapshot_shows_each_transfers_source_and_destination_pages() -> None:
    """The snapshot of a transfer in flight names the pages it reads and writes."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    x = core.start(Direction.D2H, node)
    assert x is not None
    view = core.snapshot().transfers[x.id]
    assert view.src == tuple(core.path_pages(node, Tier.L1))
    assert view.dst == tuple(x.dst) and len(view.dst) == 2


def test_coverage_counts_every_traced_transition_once() -> None:
    """In tracing mode, ``coverage`` is the count of each (state, event) in the trace."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    through(core, node, Direction.D2H)
    tree = core.tree
    assert tree.trace
    assert tree.coverage == Counter((e.before, e.event) for e in tree.trace)
    assert all(n > 0 for n in tree.coverage.values())


def test_a_refused_event_on_a_private_run_says_so() -> None:
    """The spec's refusal of an event on a private run names the event and the private run."""
    tree = HiRadixTree(2)
    with pytest.raises(TransitionRefused, match=r"^spec refuses 'start_d2h' on a private run$"):
        tree.expect(None, Event.START_D2H)


def test_removing_a_run_with_children_names_the_cause_and_changes_nothing() -> None:
    """Unlinking a run that still has children is an IntegrityError saying why; the run stays."""
    tree = HiRadixTree(2)
    upper = tree.new_node((1, 2), tree.root)
    lower = tree.new_node((3, 4), upper)
    with pytest.raises(IntegrityError, match="removing a node that has children") as err:
        tree.remove(upper)
    assert err.value.invariant == "structure"
    assert upper.alive and tree.root.children[(1, 2)] is upper and upper.children[(3, 4)] is lower
