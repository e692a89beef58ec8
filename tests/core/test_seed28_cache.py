"""Contracts of ``CacheCore`` that the seed-28 mutation draw found unchecked: adopt's page
count for a prompt with a partial last page and its private-page check, a transfer's
destination pin leaving its parent's age alone, discovery of a prefix already in L3 and
of keys given for a run, and ensure_free evicting no more than it must."""

from __future__ import annotations

import pytest

from hicache.core import CacheCore, TierSizes
from hicache.errors import PageOwnershipError
from hicache.spec.model import Direction, Tier
from tests.core.test_tree import make, prefill, through


def test_adopt_takes_one_page_per_whole_page_of_an_unaligned_prompt() -> None:
    """A 5-token prompt at page size 2 is adopted with 2 pages: the partial last page is
    not part of it."""
    core = CacheCore(2, TierSizes(8, 8, 8))
    pages = core.allocate_l1(2)
    assert pages is not None
    result = core.adopt((1, 2, 3, 4, 5), pages, 0)
    assert result.length == 4 and result.pages == pages
    assert core.match((1, 2, 3, 4, 5)).lengths == (4, 0, 0)


@pytest.mark.parametrize("bad", ["repeated", "not-private"])
def test_adopt_refuses_pages_past_the_prefix_that_are_not_distinct_private_pages(bad: str) -> None:
    """One private page given twice, or two distinct pages no longer private, past the
    pinned prefix: PageOwnershipError, and the tree and free pages are unchanged."""
    core = CacheCore(2, TierSizes(8, 8, 8))
    pages = core.allocate_l1(2)
    assert pages is not None
    if bad == "repeated":
        given = [pages[0], pages[0]]
    else:
        core.free_private(pages)
        given = list(pages)
    before = core.snapshot()
    with pytest.raises(PageOwnershipError, match="distinct private pages"):
        core.adopt((1, 2, 3, 4), given, 0)
    assert core.snapshot() == before


def test_a_backup_below_a_run_leaves_that_runs_age_in_the_target_tier() -> None:
    """A D2H of a run whose parent is already in L2 pins the parent's L2 copy without
    using it: once withdrawn, the parent is still the older L2 copy, evicted first."""
    core = make()
    parent = prefill(core, (1, 2))
    through(core, parent, Direction.D2H)
    other = prefill(core, (3, 4))
    through(core, other, Direction.D2H)  # a younger L2 copy than the parent's
    child = prefill(core, (1, 2, 5, 6))
    assert child.parent is parent
    x = core.start(Direction.D2H, child)
    assert x is not None and x.nodes == [child]
    core.cancel(x)
    assert core.lru_victim(Tier.L2) is parent


def test_discovering_a_prefix_already_in_l3_changes_no_run() -> None:
    """A shared store reporting the first 2 pages of a 4-page run the tree already holds in
    L3: the match is those 4 tokens, and no run is split or added."""
    core = make()
    tokens = tuple(range(8))
    node = prefill(core, tokens)
    through(core, node, Direction.D2H, Direction.H2S)
    runs = sorted(n.key for n in core.tree.iter_nodes())
    m = core.discover(tokens, 2)
    assert m.length == 4
    assert sorted(n.key for n in core.tree.iter_nodes()) == runs
    assert node.alive and len(node.key) == 8


def test_discover_keeps_the_keys_it_is_given_on_a_run_it_records() -> None:
    """Keys passed to discover for a run the tree held only in L1 are that run's content
    keys from then on (``page_keys`` returns them, whatever the seed)."""
    core = make()
    tokens = (1, 2, 3, 4)
    node = prefill(core, tokens)
    keys = [b"a" * 16, b"b" * 16]
    assert core.discover(tokens, 2, keys).length == 4
    assert node.has(Tier.L3)
    assert core.page_keys(node, bytes(16)) == keys


def test_ensure_free_evicts_only_the_pages_still_missing() -> None:
    """With 1 of 4 L1 pages free, making 2 free evicts one run (the oldest of three
    one-page runs) and keeps the other two."""
    core = make(l1=4)
    runs = [prefill(core, (k, k)) for k in (1, 2, 3)]
    assert core.l1.num_free == 1
    assert core.ensure_free(Tier.L1, 2)
    assert core.l1.num_free == 2
    assert [n.alive for n in runs] == [False, True, True]
    assert core.evictions[Tier.L1] == 1
