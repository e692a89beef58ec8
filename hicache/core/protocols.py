"""What the controller needs from backends (``hicache.backends`` implements these)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hicache.spec.model import Direction


class TimingsLike(Protocol):
    enqueue_s: float
    setup_s: float
    queue_s: float
    service_s: float
    complete_s: float
    total_s: float

    @property
    def recurring_s(self) -> float: ...


class TicketLike(Protocol):
    """An asynchronous copy: ``poll()`` without blocking, ``wait()`` blocking; ``ok`` is
    None while pending; a failed ticket published nothing."""

    ok: bool | None
    error: str | None
    nbytes: int
    extents: int

    @property
    def timings(self) -> TimingsLike: ...

    def poll(self) -> bool: ...

    def wait(self) -> bool: ...

    def cancel(self) -> bool:
        """Withdraw work not yet started: True if nothing was or will be written."""
        ...


class DeviceMover(Protocol):
    """L1 <-> L2 (``TransferEngine``)."""

    @property
    def layered(self) -> bool:
        """Whether :meth:`h2d` can signal each layer as it lands (else all at the end)."""
        ...

    def layer_groups(self) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` layer ranges a layered H2D moves, in order."""
        ...

    def d2h(self, src: Sequence[int], dst: Sequence[int]) -> TicketLike: ...

    def h2d(self, src: Sequence[int], dst: Sequence[int], layer_events: Sequence[Any] | None = None) -> TicketLike:
        """``layer_events``: one per layer, each recorded once that layer of every page has
        landed (or all at the end, by a mover that cannot order by layer)."""
        ...

    def status(self) -> dict[str, Any]: ...


class StorageTicketLike(TicketLike, Protocol):
    """An L3 ticket. ``lost``: the store no longer had a page (a shared store: the tree drops
    that run's L3 copy). ``expired``: failed by its deadline while its I/O still ran; until
    ``settled``, that I/O may still touch its pages."""

    lost: bool
    expired: bool
    settled: bool


class StorageMover(Protocol):
    """L2 <-> L3 (``hicache.backends.stores.StoreMover``). A keyed store names pages by the
    content keys it is given (slots are then the tree's bookkeeping only); a shared one can
    gain and lose pages behind our back (``exists`` asks; a read that finds one gone is
    ``lost``)."""

    @property
    def persistent(self) -> bool:
        """Whether what is written outlives this process (a copy to it is worth finishing)."""
        ...

    @property
    def keyed(self) -> bool: ...

    @property
    def shared(self) -> bool: ...

    @property
    def available(self) -> bool:
        """False once the store is unreachable: the cache serves on without L3."""
        ...

    def write(
        self,
        host_pages: Sequence[int],
        slots: Sequence[int],
        keys: Sequence[bytes] | None = None,
        *,
        above: Sequence[bytes] = (),
    ) -> StorageTicketLike:
        """H2S. ``above``: the keys of the prompt's pages before these (a keyed store that
        evicts by recency ranks them as used after these: a page is reachable only through
        the ones before it)."""
        ...

    def read(
        self,
        slots: Sequence[int],
        host_pages: Sequence[int],
        keys: Sequence[bytes] | None = None,
        *,
        above: Sequence[bytes] = (),
    ) -> StorageTicketLike:
        """S2H; ``above`` as for :meth:`write`."""
        ...

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the store holds (bounded in pages and time; 0 on error)."""
        ...

    def close(self, *, wait: bool = True) -> None: ...

    def status(self) -> dict[str, Any]: ...


class PageVerifier(Protocol):
    """Checks a finished transfer's destination pages before they are published
    (``HiCacheConfig.verify_pages``): an error message fails the transfer (the request
    recomputes); None lets it publish."""

    def verify(self, direction: Direction, src: Sequence[int], dst: Sequence[int]) -> str | None: ...

    def forget_slots(self, slots: Sequence[int]) -> None:
        """These L3 slots now hold pages another instance wrote (a shared store's, found
        by discovery): whatever digest was taken of them before belongs to other pages."""
        ...
