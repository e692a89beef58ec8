"""Typed, JSON-serializable status of the core."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TierStatus:
    tier: str
    capacity: int
    free: int
    protected: int  # published pages held by a lease
    evictable: int  # published pages nobody holds
    in_flight: int  # private destination pages of transfers into this tier
    private: int  # L1 pages owned by requests
    evicted: int  # pages evicted so far


@dataclass(frozen=True, slots=True)
class CoreStatus:
    page_size: int
    tiers: list[TierStatus]
    transfers_in_flight: dict[str, int]
    nodes: int
    leases: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class ControllerStatus:
    """The controller's status (DESIGN.md §8): the core's tiers, pending work, the chosen
    transfer backends and their autotune timings, the storage, the cost model's state and
    the metrics. ``to_dict()`` is JSON-serializable."""

    core: CoreStatus
    pending_backups: int
    pending_restores: int
    requests: int  # admitted and not released
    request_states: dict[str, int]  # live requests per ReqState
    write_policy: str
    transfer: dict[str, Any]
    storage: dict[str, Any] | None
    cost_model: dict[str, Any]
    metrics: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
