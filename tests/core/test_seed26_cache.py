"""Contracts of ``CacheCore`` that the seed-26 mutation draw found unchecked: inserting along
a path of several runs, a pinned page found elsewhere, finishing a transfer twice, the
eviction trace, trimming a match twice, status counts and integrity errors' fields."""

from __future__ import annotations

import re

import pytest

from hicache.core import CacheCore, DevicePage, TierSizes
from hicache.errors import HandleError, IntegrityError
from hicache.spec.model import Direction, Event, RunState, Tier


def make(ps: int = 2) -> CacheCore:
    return CacheCore(ps, TierSizes(16, 16, 16), tracing=True)


def fill(core: CacheCore, prompt: tuple[int, ...]) -> list[DevicePage]:
    """Insert ``prompt`` with the tree's pages of its L1 hit and fresh private pages for the
    rest; the tree's L1 pages of it."""
    hit = core.match(prompt).l1
    pages = core.allocate_l1(len(prompt) // core.page_size - hit.length // core.page_size)
    assert pages is not None
    result = core.insert(prompt, [*core.pages_l1(hit), *pages])
    assert result.rejected == []
    return result.pages


def test_insert_accepts_the_trees_own_pages_along_a_path_of_two_runs() -> None:
    """A prompt that extends a path of two runs may hand back the tree's pages of both runs
    (as a request that matched them does); only its private page is new."""
    core = make()
    upper = fill(core, (1, 2, 3, 4))
    both = fill(core, (1, 2, 3, 4, 5, 6, 7, 8))  # a second run below the first
    assert both[:2] == upper
    new = core.allocate_l1(1)
    assert new is not None
    result = core.insert((1, 2, 3, 4, 5, 6, 7, 8, 9, 10), [*both, *new])
    assert (result.length, result.rejected, result.pages) == (10, [], [*both, *new])
    core.check_integrity()


def test_a_pinned_page_found_as_another_is_an_integrity_error_naming_both() -> None:
    """``adopt`` with a pinned prefix whose page is not the tree's page there is a pinning
    bug: IntegrityError("pinning") at the run, naming the page given and the one found."""
    core = make()
    tree_pages = fill(core, (1, 2, 3, 4))
    node = core.match((1, 2, 3, 4)).l1.node
    own = core.allocate_l1(2)
    assert own is not None
    wrong, extra = own
    with pytest.raises(IntegrityError) as caught:
        core.adopt((1, 2, 3, 4, 5, 6), [tree_pages[0], wrong, extra], prefix=2)
    err = caught.value
    assert (err.invariant, err.where, err.detail) == (
        "pinning",
        repr(node),
        f"pinned page {wrong} found as {tree_pages[1]}",
    )


def test_finishing_a_transfer_twice_names_the_transfer() -> None:
    """Completing, failing or cancelling a transfer already completed raises HandleError
    naming it by id."""
    core = make()
    fill(core, (1, 2, 3, 4))
    node = core.match((1, 2, 3, 4)).l1.node
    x = core.start(Direction.D2H, node)
    assert x is not None
    core.complete(x)
    expected = rf"^{re.escape(f'transfer #{x.id} already finished or unknown')}$"
    for finish in (core.complete, core.fail, core.cancel):
        with pytest.raises(HandleError, match=expected):
            finish(x)


def test_evicting_the_last_copy_is_traced_on_the_run_then_its_removal() -> None:
    """Evicting a run's only copy logs two entries on that run: L1 --evict_l1--> EMPTY,
    then EMPTY --remove--> REMOVED."""
    core = make()
    fill(core, (1, 2, 3, 4))
    node = core.match((1, 2, 3, 4)).l1.node
    assert core.evict(Tier.L1, 100) == 2
    assert [(e.node, e.before, e.event, e.after) for e in core.tree.trace[-2:]] == [
        (node.id, RunState.L1, Event.EVICT_L1, RunState.EMPTY),
        (node.id, RunState.EMPTY, Event.REMOVE, RunState.REMOVED),
    ]


def test_trimming_the_same_match_twice_gives_the_same_upper_run() -> None:
    """A match ending inside a run, trimmed once, splits the run at its end; trimming the
    old match again finds that upper run (its end now exactly there) and splits nothing."""
    core = make()
    fill(core, (1, 2, 3, 4, 5, 6, 7, 8))
    match = core.match((1, 2, 3, 4)).l1
    first = core.trim(match)
    assert first.node is not match.node and first.node.key == (1, 2, 3, 4)
    nodes = len(core.tree.nodes)
    second = core.trim(match)
    assert (second.tier, second.length, second.node, second.version) == (
        Tier.L1,
        4,
        first.node,
        first.version,
    )
    assert len(core.tree.nodes) == nodes


def test_status_reports_the_page_size_and_the_runs_below_the_root() -> None:
    """status() gives the core's page size and the number of runs (the root not counted):
    0 when empty, 3 after two prompts that share their first page."""
    core = make(ps=2)
    assert (core.status().page_size, core.status().nodes) == (2, 0)
    fill(core, (1, 2, 3, 4))
    fill(core, (1, 2, 5, 6))
    st = core.status()
    assert (st.page_size, st.nodes) == (2, 3)
    assert (make(ps=4).status().page_size, make(ps=4).status().nodes) == (4, 0)


def test_check_integrity_reports_the_invariant_where_and_detail() -> None:
    """A page both free and claimed private breaks ownership: the IntegrityError carries the
    invariant, the place (the tier) and the detail (the page and its owner count)."""
    core = make()
    core.private.add(7)
    with pytest.raises(IntegrityError) as caught:
        core.check_integrity()
    err = caught.value
    assert (err.invariant, err.where, err.detail) == ("ownership", "tier L1", "page 7 has 2 owners")
