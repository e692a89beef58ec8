"""The batched page-store contract behind L3 (DESIGN.md §6b), and the ticket it completes.

A :class:`PageStore` moves whole pages between L2 (the host pool) and one store, in
batches, with one status per page. It is synchronous and called only from the mover's
I/O threads (:mod:`hicache.backends.stores.mover`), never from the scheduler thread:

- ``plan(op, host_pages, slots)``: cut one request into chunks, ``(first, end)`` index
  ranges covering it in order, that the I/O threads run in parallel, and count its extents
  (contiguous runs in the store); may announce reads (readahead). Never blocks on I/O.
- ``put(host_pages, slots, keys)``: store the pages; per page OK, EXISTS (already there,
  not written again), FULL or FAILED. Raises OSError when the whole call failed.
- ``get(host_pages, slots, keys)``: load the pages into L2; per page OK, MISSING (not in
  the store: lost), CORRUPT (checksum or format wrong: never served, dropped) or FAILED.
- ``exists(keys)``: how many LEADING keys the store holds (0 for an unkeyed store).

Unkeyed stores (``file``) address pages by slot and ignore keys; keyed stores (``dir``,
``mooncake``) address them by key and ignore slots. ``shared`` stores can gain and lose
pages behind our back (another process, a restart), so a read may find a page gone.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from hicache.backends.ticket import Ticket

Op = Literal["read", "write"]


class PageStatus(enum.IntEnum):
    """What happened to one page of a batch."""

    OK = 0
    EXISTS = 1  # put: the store already had it; not written again
    MISSING = 2  # get: the store does not have it (evicted, restarted, never written)
    CORRUPT = 3  # get: its bytes or header are wrong; never served, dropped from the store
    FAILED = 4  # an I/O or store error; the page may still be there
    FULL = 5  # put: no room
    SKIPPED = 6  # never attempted (the request's deadline passed, or the mover closed)


LOST = frozenset({PageStatus.MISSING, PageStatus.CORRUPT})
STORED = frozenset({PageStatus.OK, PageStatus.EXISTS})


class PageStore(Protocol):
    """One L3 implementation (``file``, ``dir``, ``mooncake``). See the module docstring."""

    kind: str
    keyed: bool
    shared: bool
    remote: bool  # calls may wait on a network: the mover bounds ``exists`` with a timeout

    def plan(self, op: Op, host_pages: Sequence[int], slots: Sequence[int]) -> tuple[list[tuple[int, int]], int]: ...

    def put(
        self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None
    ) -> list[PageStatus]: ...

    def get(
        self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None
    ) -> list[PageStatus]: ...

    def exists(self, keys: Sequence[bytes]) -> int: ...

    @property
    def available(self) -> bool:
        """False while the store cannot be reached (every request then fails fast)."""
        ...

    def close(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


@dataclass(eq=False)
class StoreTicket(Ticket):
    """A storage ticket. Beyond :class:`Ticket`:

    ``lost``: some page was MISSING or CORRUPT in the store (the tree must drop its L3 copy;
    the request recomputes). ``statuses``: one :class:`PageStatus` per page, once finished.
    ``expired``: failed by its deadline while I/O was still running. Until ``settled`` is
    True, the pages in ``held_host_pages`` / ``held_slots`` are still being read or written
    by that I/O and must not be reused (:meth:`StoreMover.reap` lists tickets that settle).
    """

    deadline: float = math.inf  # perf_counter time after which it fails
    lost: bool = False
    expired: bool = False
    statuses: list[PageStatus] = field(default_factory=list)
    held_host_pages: list[int] = field(default_factory=list)
    held_slots: list[int] = field(default_factory=list)
    settled: bool = True
