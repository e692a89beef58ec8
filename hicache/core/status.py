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
