"""Plain-data views of a cache the invariants are stated over (no dependency on ``core``)."""

from __future__ import annotations

from dataclasses import dataclass

from hicache.spec.model import Direction, Tier
from hicache.spec.request import ReqState

Pages = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NodeView:
    id: int
    parent: int | None
    key: tuple[int, ...]
    children: tuple[tuple[tuple[int, ...], int], ...]  # (dict key, child id)
    pages: tuple[Pages | None, ...]  # per tier
    refs: tuple[int, ...]  # per tier
    stamp: tuple[int, ...]  # per tier
    tier_children: tuple[int, ...]  # per tier, as stored
    inflight: tuple[int | None, ...]  # per direction: transfer id
    pending: tuple[Pages | None, ...]  # per direction
    alive: bool


@dataclass(frozen=True, slots=True)
class TransferView:
    id: int
    direction: Direction
    nodes: tuple[int, ...]
    src: Pages
    dst: Pages
    src_lease: int
    dst_lease: int | None


@dataclass(frozen=True, slots=True)
class LeaseView:
    id: int
    tier: Tier
    node: int
    alive: bool
    length: int = 0  # tokens the holder uses (page aligned)


@dataclass(frozen=True, slots=True)
class RequestView:
    """A live request as the controller holds it (DESIGN.md §4b)."""

    id: int
    state: ReqState
    cached_len: int
    pages: Pages  # L1 pages of [0, cached_len)
    lease: int | None  # its L1 pin
    source: int | None  # its pin on the run a restore reads
    transfer: int | None  # the restore's transfer in flight
    restore_pages: Pages | None  # a layered restore's pages of [0, restore_tokens)
    restore_tokens: int
    private: Pages


@dataclass(frozen=True, slots=True)
class Snapshot:
    page_size: int
    capacity: tuple[int, ...]  # per tier
    free: tuple[Pages, ...]  # per tier
    private: Pages  # L1 pages owned by requests
    root: int
    nodes: dict[int, NodeView]
    transfers: dict[int, TransferView]
    leases: dict[int, LeaseView]
    protected: tuple[int, ...]  # stored counters, per tier
    evictable: tuple[int, ...]
    index: tuple[frozenset[tuple[int, int]], ...]  # eviction index entries (node id, stamp)
    requests: dict[int, RequestView] | None = None  # None: a bare core (no request level)
