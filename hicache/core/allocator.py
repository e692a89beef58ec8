"""A page allocator per tier that prefers consecutive runs.

The DMA fast path (one copy straight into the L2 pool, one file extent per run) depends on
destination pages being consecutive, so free pages are kept as maximal runs::

    free flags  1 1 1 0 0 1 1 1 1 0 1
    runs        [0,3)     [5,9)    [10,11)      (start -> length, and length-ordered)

``allocate(n)`` takes the smallest run of length >= n (best fit, one run); failing that, the
largest runs first (fewest fragments). ``free`` merges with both neighbours. Both are
O(log n) per run touched; nothing re-sorts the free list per call, and allocate() does not
allocate Python objects beyond its result.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Generic, TypeVar

from sortedcontainers import SortedList

from hicache.errors import ConfigError, PageOwnershipError

P = TypeVar("P", bound=int)


class PageAllocator(Generic[P]):
    """Free-page bookkeeping for one tier of ``capacity`` pages, ids ``0..capacity-1``."""

    __slots__ = ("_by_len", "_end_start", "_free", "_num_free", "_start_len", "capacity", "name")

    def __init__(self, capacity: int, name: str = "pages") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"{name} capacity must be a non-negative int, got {capacity!r}")
        self.name = name
        self.capacity = capacity
        self._free = bytearray(b"\x01") * capacity
        self._num_free = capacity
        self._start_len: dict[int, int] = {}
        self._end_start: dict[int, int] = {}
        self._by_len: SortedList = SortedList()
        if capacity:
            self._add_run(0, capacity)

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._num_free

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed now."""
        return 0 <= n <= self._num_free

    def is_free(self, page: int) -> bool:
        return 0 <= page < self.capacity and bool(self._free[page])

    def free_pages(self) -> Iterator[P]:
        """Every free page, ascending (O(capacity); for integrity checks and tests)."""
        for start in sorted(self._start_len):
            yield from range(start, start + self._start_len[start])  # type: ignore[misc]

    def runs(self) -> list[tuple[int, int]]:
        """The free runs as ``(start, length)``, ascending by start."""
        return sorted(self._start_len.items())

    # -- mutation ------------------------------------------------------------------------

    def allocate(self, n: int) -> list[P] | None:
        """``n`` pages, consecutive when any free run is long enough (the shortest such run);
        otherwise from the longest runs first, so in as few pieces as the free runs allow.
        None if too few are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PageOwnershipError(f"{self.name}: page count must be a non-negative int, got {n!r}")
        if n > self._num_free:
            return None
        out: list[int] = []
        idx = self._by_len.bisect_left((n, -1))
        if idx < len(self._by_len):
            length, start = self._by_len[idx]
            self._take(start, length, n, out)
        else:
            need = n
            while need:
                length, start = self._by_len[-1]
                take = min(need, length)
                self._take(start, length, take, out)
                need -= take
        self._num_free -= n
        return out  # type: ignore[return-value]

    def free(self, pages: Iterable[P]) -> None:
        """Return pages. Raises PageOwnershipError (changing nothing) on a bad page."""
        ordered = sorted(pages)
        self.check_allocated(ordered)
        # NOTE: distinct and ascending, so ordered[k] - k never falls and is constant over a
        # run of consecutive pages: each run's end is a bisection, not a walk of its pages
        # (an engine frees a whole prompt's pages at once, on the path to the next restore).
        n, i = len(ordered), 0
        while i < n:
            base = ordered[i] - i
            j = (
                n
                if ordered[-1] - (n - 1) == base
                else bisect_right(range(n), base, i + 1, n, key=lambda k: ordered[k] - k)
            )
            self._release(ordered[i], j - i)
            i = j
        self._num_free += n

    def check_allocated(self, ordered: Sequence[int]) -> None:
        """Raise PageOwnershipError unless ``ordered`` (ascending) are distinct allocated pages."""
        if not ordered:
            return
        # NOTE: C-level checks first; the loop below only runs to name the bad page.
        if (
            set(map(type, ordered)) == {int}
            and min(ordered) >= 0
            and max(ordered) < self.capacity
            and len(set(ordered)) == len(ordered)
        ):
            free = itemgetter(*ordered)(self._free) if len(ordered) > 1 else (self._free[ordered[0]],)
            if not any(free):
                return
        prev = -1
        for page in ordered:
            if isinstance(page, bool) or not isinstance(page, int):
                raise PageOwnershipError(f"{self.name}: page ids must be ints, got {page!r}")
            if not 0 <= page < self.capacity:
                raise PageOwnershipError(f"{self.name}: page {page} out of range [0, {self.capacity})")
            if page == prev:
                raise PageOwnershipError(f"{self.name}: page {page} given twice")
            if self._free[page]:
                raise PageOwnershipError(f"{self.name}: page {page} is already free")
            prev = page

    # -- runs ----------------------------------------------------------------------------

    def _add_run(self, start: int, length: int) -> None:
        self._start_len[start] = length
        self._end_start[start + length] = start
        self._by_len.add((length, start))

    def _drop_run(self, start: int, length: int) -> None:
        del self._start_len[start]
        del self._end_start[start + length]
        self._by_len.remove((length, start))

    def _take(self, start: int, length: int, n: int, out: list[int]) -> None:
        self._drop_run(start, length)
        if length > n:
            self._add_run(start + n, length - n)
        self._free[start : start + n] = bytes(n)
        out.extend(range(start, start + n))

    def _release(self, start: int, length: int) -> None:
        self._free[start : start + length] = b"\x01" * length
        before = self._end_start.get(start)
        if before is not None:
            blen = self._start_len[before]
            self._drop_run(before, blen)
            start, length = before, blen + length
        after_len = self._start_len.get(start + length)
        if after_len is not None:
            self._drop_run(start + length, after_len)
            length += after_len
        self._add_run(start, length)
