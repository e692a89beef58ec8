"""Page guard (``HiCacheConfig.guard_pages``): catches an engine that writes L1 pages it does
not own. For tests, over small pools: each check reads every free and published L1 page.

Two rules of the contract (DESIGN.md §5) that no state machine sees, because they are about
bytes, not about who holds a page:

- **A free page is written by no one.** A page is free between a ``release`` (or an eviction,
  or a failed transfer) and the next ``allocate`` or transfer that takes it. The guard fills
  it with 0xFF bytes (NaN in a float K/V: a page read before anyone wrote it shows) and, at
  the start of the next cache call, finds it changed if the engine wrote into it meanwhile (a
  decode step after ``release``, a prefill into pages an aborted request held).
- **A published page is read-only.** A page of the tree (``prefix_pages``, what ``insert``
  handed over, what a restore published) holds a cached prefix other requests read. The
  guard digests it when it is published and finds it changed if the engine wrote into it
  (a prefill that writes the cached prefix, K/V written after ``insert``).

What hicache itself writes into a free page during a call (a transfer's destination that
failed) is filled again at the end of that call; a page freed or published outside the
cache's calls (by code reaching into its internals) is watched from the end of the next.
The first broken rule is kept and raised by ``check_integrity`` as
:class:`~hicache.errors.PageContentError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import xxhash

from hicache.backends.pools import DevicePool
from hicache.errors import PageContentError

POISON = 0xFF

Identity = tuple[int, int]  # (node id, its L1 version): the publication a digest belongs to


class PageGuard:
    def __init__(self, l1: DevicePool) -> None:
        self.bytes = l1.slabs.view(torch.uint8)  # [2 * layers, pages, bytes of a page's slab row]
        self.digests: dict[int, tuple[Identity, int]] = {}
        self.poisoned: set[int] = set(range(self.bytes.shape[1]))  # free and filled at the last call's end
        self.private: set[int] = set()  # the requests' own pages at the call's start
        self.broken: str | None = None  # the first broken rule, kept for check_integrity
        self.bytes[:] = POISON

    def _dirty(self, pages: list[int]) -> list[int]:
        """Of ``pages``, those not all 0xFF."""
        if not pages:
            return []
        idx = torch.tensor(pages, dtype=torch.long, device=self.bytes.device)
        clean = (self.bytes[:, idx] == POISON).all(dim=2).all(dim=0).tolist()
        return [p for p, ok in zip(pages, clean, strict=True) if not ok]

    def _digest(self, page: int) -> int:
        return xxhash.xxh3_64_intdigest(self.bytes[:, page].contiguous().cpu().numpy().tobytes())

    def before(self, free: Iterable[int], published: Mapping[int, Identity], private: set[int]) -> None:
        """At a call's start: what the engine did since the last call."""
        self.private = private
        if self.broken is not None:
            return
        dirty = self._dirty(sorted(self.poisoned.intersection(free)))
        if dirty:
            self.broken = (
                f"L1 page {dirty[0]} was written while free (after a release or an eviction freed it, before "
                "allocate handed it out): a page is the engine's from allocate to its request's release"
            )
            return
        for page, who in published.items():
            seen = self.digests.get(page)
            if seen is not None and seen[0] == who and self._digest(page) != seen[1]:
                self.broken = (
                    f"L1 page {page} of a cached prefix changed since it was published: an engine writes only "
                    "the pages allocate handed it (not prefix_pages), and only before insert hands them over"
                )
                return

    def after(self, free: Iterable[int], published: Mapping[int, Identity], private: set[int]) -> None:
        """At a call's end: fill the free pages hicache wrote in it and the pages it handed
        out (an allocate that evicts hands out pages that were never free), digest new
        publications."""
        free = sorted(free)
        dirty = self._dirty(free) + sorted(private - self.private)
        if dirty:
            idx = torch.tensor(dirty, dtype=torch.long, device=self.bytes.device)
            self.bytes[:, idx] = POISON
        self.poisoned = set(free)
        self.digests = {
            page: seen if (seen := self.digests.get(page)) is not None and seen[0] == who else (who, self._digest(page))
            for page, who in published.items()
        }

    def check(self) -> None:
        if self.broken is not None:
            raise PageContentError(self.broken)
