"""Movers that move content *tags*, not bytes, and hold every copy until told to finish it.

They implement :class:`~hicache.core.protocols.DeviceMover` and
:class:`~hicache.core.protocols.StorageMover` over one :class:`TagFabric`: per tier an int
tag per page (as :class:`~hicache.testing.fake_backend.FakeBackend`), a destination poisoned
when its copy is issued and written only when it completes. Issued copies wait in
:attr:`TagFabric.queue` (kept in a canonical order) until a driver completes, fails, expires
or settles them; ``wait()`` completes one at once (the controller waits synchronously under
write_back). A copy can be withdrawn (``cancel``) until the driver marks it ``begun``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hicache.spec.model import Direction, Tier
from hicache.testing.fake_backend import EMPTY, POISON


@dataclass(slots=True)
class ZeroTimings:
    """A copy's timings: all zero (nothing here takes time)."""

    enqueue_s: float = 0.0
    setup_s: float = 0.0
    queue_s: float = 0.0
    service_s: float = 0.0
    complete_s: float = 0.0
    total_s: float = 0.0

    @property
    def recurring_s(self) -> float:
        return 0.0


class TagTicket:
    """One issued copy (a :class:`~hicache.core.protocols.StorageTicketLike`): ``ok`` is
    None while queued; ``expired`` and not ``settled``: failed by its deadline, its I/O
    still running."""

    def __init__(self, fabric: TagFabric, direction: Direction, src: Sequence[int], dst: Sequence[int]) -> None:
        self.fabric = fabric
        self.direction = direction
        self.src = tuple(src)
        self.dst = tuple(dst)
        self.ok: bool | None = None
        self.error: str | None = None
        self.nbytes = len(self.dst)
        self.extents = 1
        self.lost = False
        self.expired = False
        self.settled = True
        self.begun = False  # the copy has started: it can no longer be withdrawn

    @property
    def timings(self) -> ZeroTimings:
        return ZeroTimings()

    @property
    def order(self) -> tuple[Direction, tuple[int, ...], tuple[int, ...]]:
        """Its place in the canonical queue order (unique: destinations are private)."""
        return (self.direction, self.src, self.dst)

    def poll(self) -> bool:
        return self.ok is not None

    def wait(self) -> bool:
        if self.ok is None:
            self.fabric.finish(self, ok=True)
        return bool(self.ok)

    def cancel(self) -> bool:
        if self.ok is not None or self.begun:
            return False
        self.fabric.queue.remove(self)
        self.ok, self.error = False, "cancelled"
        return True


class TagFabric:
    """The tags of every page of every tier, and the copies issued and not yet finished."""

    def __init__(self, capacities: Sequence[int]) -> None:
        self.content: list[list[int]] = [[EMPTY] * capacities[t] for t in Tier]
        self.queue: list[TagTicket] = []  # sorted by TagTicket.order

    def issue(self, direction: Direction, src: Sequence[int], dst: Sequence[int]) -> TagTicket:
        ticket = TagTicket(self, direction, src, dst)
        target = self.content[direction.target]
        for page in ticket.dst:
            target[page] = POISON
        self.queue.append(ticket)
        self.queue.sort(key=lambda t: t.order)
        return ticket

    def finish(self, ticket: TagTicket, *, ok: bool, lost: bool = False) -> None:
        """The copy ends: on success its tags land in the destination."""
        self.queue.remove(ticket)
        if ok:
            src, dst = self.content[ticket.direction.source], self.content[ticket.direction.target]
            for s, d in zip(ticket.src, ticket.dst, strict=True):
                dst[d] = src[s]
        ticket.ok, ticket.error, ticket.lost = ok, None if ok else ("lost" if lost else "failed"), lost

    def expire(self, ticket: TagTicket) -> None:
        """An L3 copy fails by its deadline; its I/O runs on (stays queued) until settled."""
        ticket.ok, ticket.error, ticket.expired, ticket.settled = False, "deadline", True, False

    def settle(self, ticket: TagTicket) -> None:
        """An expired copy's I/O returned: it touches its pages no more."""
        self.queue.remove(ticket)
        ticket.settled = True

    def tags(self, tier: Tier, pages: Sequence[int]) -> list[int]:
        return [self.content[tier][p] for p in pages]


class TagDevice:
    """L1 <-> L2 over a :class:`TagFabric` (a :class:`~hicache.core.protocols.DeviceMover`)."""

    def __init__(self, fabric: TagFabric) -> None:
        self.fabric = fabric

    @property
    def layered(self) -> bool:
        return False

    def layer_groups(self) -> list[tuple[int, int]]:
        return [(0, 1)]

    def d2h(self, src: Sequence[int], dst: Sequence[int]) -> TagTicket:
        return self.fabric.issue(Direction.D2H, src, dst)

    def h2d(self, src: Sequence[int], dst: Sequence[int], layer_events: Sequence[Any] | None = None) -> TagTicket:
        return self.fabric.issue(Direction.H2D, src, dst)

    def status(self) -> dict[str, Any]:
        return {"backend": "tags"}


class TagStorage:
    """L2 <-> L3 over a :class:`TagFabric` (a :class:`~hicache.core.protocols.StorageMover`):
    private, unkeyed, not persistent, always reachable."""

    def __init__(self, fabric: TagFabric) -> None:
        self.fabric = fabric

    @property
    def persistent(self) -> bool:
        return False

    @property
    def keyed(self) -> bool:
        return False

    @property
    def shared(self) -> bool:
        return False

    @property
    def available(self) -> bool:
        return True

    def write(
        self,
        host_pages: Sequence[int],
        slots: Sequence[int],
        keys: Sequence[bytes] | None = None,
        *,
        above: Sequence[bytes] = (),
    ) -> TagTicket:
        return self.fabric.issue(Direction.H2S, host_pages, slots)

    def read(
        self,
        slots: Sequence[int],
        host_pages: Sequence[int],
        keys: Sequence[bytes] | None = None,
        *,
        above: Sequence[bytes] = (),
    ) -> TagTicket:
        return self.fabric.issue(Direction.S2H, slots, host_pages)

    def exists(self, keys: Sequence[bytes]) -> int:
        return 0

    def close(self, *, wait: bool = True) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"store": "tags"}
