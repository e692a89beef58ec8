"""Counters of DESIGN.md §8, JSON-serializable, with a Prometheus text exposition."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from hicache.spec.model import Direction


@dataclass
class DirectionStats:
    count: int = 0
    failed: int = 0
    bytes: int = 0
    steady_s: float = 0.0  # recurring seconds (one-time setup excluded)
    enqueue_s: float = 0.0
    setup_s: float = 0.0
    queue_s: float = 0.0
    service_s: float = 0.0
    total_s: float = 0.0
    extents: int = 0

    @property
    def gib_per_s(self) -> float:
        return self.bytes / self.steady_s / 2**30 if self.steady_s > 0 else 0.0


@dataclass
class Metrics:
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"L1": 0, "L2": 0, "L3": 0})
    recomputed_tokens: int = 0
    promotions: int = 0  # L3 -> L2 runs published
    fallbacks: int = 0  # restores that failed or could not start: the request recomputed
    policy_skips: int = 0  # a longer hit existed, the policy chose to recompute
    backups_skipped: int = 0  # write-through skipped: no room could be made
    restores: int = 0
    restore_s: float = 0.0
    restore_overlapped_s: float = 0.0
    verified_pages: int = 0  # pages whose digest was checked after a transfer (verify_pages)
    verify_failures: int = 0  # transfers failed because a page's digest differed
    directions: dict[str, DirectionStats] = field(default_factory=lambda: {d.name: DirectionStats() for d in Direction})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name, stats in self.directions.items():
            out["directions"][name]["gib_per_s"] = stats.gib_per_s
        return out

    def prometheus(self, evictions: dict[str, int], prefix: str = "hicache") -> str:
        """The metrics in Prometheus text format (prometheus_client)."""
        from prometheus_client import CollectorRegistry, Gauge, generate_latest

        reg = CollectorRegistry()

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"{prefix}_{name}", doc, labels, registry=reg)

        g = gauge("hit_tokens", "Prompt tokens found per tier", ("tier",))
        for tier, n in self.hit_tokens.items():
            g.labels(tier).set(n)
        g = gauge("evicted_pages", "Pages evicted per tier", ("tier",))
        for tier, n in evictions.items():
            g.labels(tier).set(n)
        for name, doc in (
            ("recomputed_tokens", "Tokens prefilled instead of restored"),
            ("promotions", "L3 runs promoted to L2"),
            ("fallbacks", "Restores that fell back to recompute"),
            ("policy_skips", "Longer hits the policy chose not to restore"),
            ("backups_skipped", "Write-through backups skipped for lack of room"),
            ("restores", "Restores completed"),
            ("restore_seconds", "End-to-end seconds of completed restores"),
            ("restore_overlapped_seconds", "Restore seconds overlapped with decode"),
            ("verified_pages", "Pages digest-checked after a transfer"),
            ("verify_failures", "Transfers failed on a page digest mismatch"),
        ):
            attr = {"restore_seconds": "restore_s", "restore_overlapped_seconds": "restore_overlapped_s"}.get(
                name, name
            )
            gauge(name, doc).set(getattr(self, attr))
        per = {
            "transfers": ("count", "Transfers completed"),
            "transfers_failed": ("failed", "Transfers failed or cancelled"),
            "transfer_bytes": ("bytes", "Bytes moved"),
            "transfer_steady_seconds": ("steady_s", "Recurring transfer seconds"),
            "transfer_queue_seconds": ("queue_s", "Seconds waiting before service"),
            "transfer_service_seconds": ("service_s", "Kernel/DMA or I/O seconds"),
            "transfer_enqueue_seconds": ("enqueue_s", "Seconds to issue transfers"),
            "transfer_setup_seconds": ("setup_s", "One-time workspace setup seconds"),
            "transfer_extents": ("extents", "L3 file extents"),
        }
        for name, (attr, doc) in per.items():
            g = gauge(name, doc, ("direction",))
            for d, stats in self.directions.items():
                g.labels(d).set(getattr(stats, attr))
        g = gauge("transfer_gib_per_second", "Steady bandwidth per direction", ("direction",))
        for d, stats in self.directions.items():
            g.labels(d).set(stats.gib_per_s)
        return generate_latest(reg).decode()
