"""PageAllocator: consecutive-run preference, exact accounting, clear errors."""

from __future__ import annotations

import itertools
import random

import pytest

from hicache.core.allocator import PageAllocator
from hicache.errors import ConfigError, PageOwnershipError


def test_fresh_allocation_is_consecutive() -> None:
    a: PageAllocator[int] = PageAllocator(64)
    assert a.allocate(10) == list(range(10))
    assert a.allocate(5) == list(range(10, 15))


def test_best_fit_prefers_a_single_run() -> None:
    """With runs of 3 and 8 free, a request for 3 takes the 3-run whole (keeps the 8)."""
    a: PageAllocator[int] = PageAllocator(20)
    pages = a.allocate(20)
    assert pages is not None
    a.free(pages[2:5])  # run of 3
    a.free(pages[10:18])  # run of 8
    got = a.allocate(3)
    assert got == [2, 3, 4]
    assert a.runs() == [(10, 8)]


def test_fragmented_allocation_uses_fewest_runs() -> None:
    a: PageAllocator[int] = PageAllocator(12)
    pages = a.allocate(12)
    assert pages is not None
    a.free([0, 1, 4, 5, 6, 10])
    got = a.allocate(5)
    assert got is not None and sorted(got) == [0, 1, 4, 5, 6]


def test_free_merges_neighbours() -> None:
    a: PageAllocator[int] = PageAllocator(10)
    pages = a.allocate(10)
    assert pages is not None
    a.free([3])
    a.free([5])
    a.free([4])
    assert a.runs() == [(3, 3)]


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    a: PageAllocator[int] = PageAllocator(4)
    assert a.allocate(3) is not None
    assert not a.can_allocate(2)
    assert a.allocate(2) is None
    assert a.num_free == 1 and a.can_allocate(1)


@pytest.mark.parametrize(
    ("bad", "message"),
    [([7], "out of range"), ([1, 1], "given twice"), ([3], "already free"), ([-1], "out of range")],
)
def test_bad_free_raises_and_changes_nothing(bad: list[int], message: str) -> None:
    a: PageAllocator[int] = PageAllocator(5)
    assert a.allocate(3) == [0, 1, 2]
    with pytest.raises(PageOwnershipError, match=message):
        a.free([0, *bad])
    assert a.num_free == 2 and a.runs() == [(3, 2)]


def test_bad_capacity_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="capacity"):
        PageAllocator(-1)


def test_random_churn_keeps_exact_accounting() -> None:
    """Under random alloc/free the free pages and runs always partition the pool."""
    rng = random.Random(7)
    a: PageAllocator[int] = PageAllocator(200)
    held: list[int] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            a.free(held[:k])
            held = held[k:]
        else:
            got = a.allocate(rng.randint(0, 20))
            if got is not None:
                held.extend(got)
        free = list(a.free_pages())
        assert len(free) == a.num_free == 200 - len(held)
        assert not set(free) & set(held)
        runs = a.runs()
        for (s1, l1), (s2, _) in itertools.pairwise(runs):
            assert s1 + l1 < s2, "adjacent runs were not merged"


def test_is_free_tells_free_from_allocated_and_out_of_range() -> None:
    """``is_free`` is True exactly for free pages inside the pool."""
    a: PageAllocator[int] = PageAllocator(6)
    assert a.allocate(2) == [0, 1]
    a.free([0])
    assert [a.is_free(p) for p in range(-1, 7)] == [False, True, False, True, True, True, True, False]


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_bad_count_raises_and_changes_nothing(bad: object) -> None:
    """A page count that is negative or not an int is misuse, not "too few pages"."""
    a: PageAllocator[int] = PageAllocator(4)
    with pytest.raises(PageOwnershipError, match="page count"):
        a.allocate(bad)  # type: ignore[arg-type]
    assert a.num_free == 4 and a.runs() == [(0, 4)]


def test_zero_and_exact_counts_at_the_boundaries() -> None:
    """allocate(0) is an empty list; the last free pages can be taken exactly; one more
    is None; can_allocate agrees at each boundary."""
    a: PageAllocator[int] = PageAllocator(3)
    assert a.can_allocate(0) and a.allocate(0) == []
    assert not a.can_allocate(-1)
    assert a.can_allocate(3) and not a.can_allocate(4)
    assert a.allocate(4) is None
    assert a.allocate(3) == [0, 1, 2]
    assert a.num_free == 0 and a.runs() == []
    assert a.allocate(1) is None


def test_zero_capacity_pool_is_empty() -> None:
    """A tier of capacity 0 has no pages and no runs; only allocate(0) succeeds."""
    a: PageAllocator[int] = PageAllocator(0)
    assert a.num_free == 0 and a.runs() == [] and list(a.free_pages()) == []
    assert a.allocate(0) == [] and a.allocate(1) is None
