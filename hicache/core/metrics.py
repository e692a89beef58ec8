"""The cache's counters and latency histograms, JSON-serializable, with a Prometheus text
exposition: counts as counters (``_total``), latencies as histograms, and levels (free
pages, pending transfers, requests) as gauges when the caller passes them."""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache.errors import ConfigError, MisuseError
from hicache.spec.model import Direction

# Seconds, from a restore of a few pages on a GPU to a cold multi-GiB read from disk.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


@dataclass
class Histogram:
    """Observations counted per upper bound (non-cumulative; the exposition accumulates)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # one per bound, then +Inf
    sum: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ConfigError(f"histogram bounds must be increasing, got {self.bounds}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        elif len(self.counts) != len(self.bounds) + 1 or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.counts
        ):
            raise ConfigError(
                f"histogram counts must be {len(self.bounds) + 1} non-negative ints (one per bound, then +Inf), "
                f"got {self.counts!r}"
            )

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count <= le)`` pairs ending with ``+Inf``, as Prometheus expects."""
        out, running = [], 0
        for le, n in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += n
            out.append((le, float(running)))
        return out


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


@dataclass(frozen=True)
class Levels:
    """Point-in-time levels the owner of the metrics knows (exported as gauges)."""

    free_pages: Mapping[str, int]  # per tier
    capacity_pages: Mapping[str, int]  # per tier
    pending_backups: int
    pending_restores: int
    requests: int  # admitted and not released


@dataclass
class Metrics:
    hit_tokens: dict[str, int] = field(default_factory=lambda: {"L1": 0, "L2": 0, "L3": 0})
    recomputed_tokens: int = 0
    promotions: int = 0  # L3 -> L2 runs published
    fallbacks: int = 0  # restores that failed or could not start: the request recomputed (not one released)
    policy_skips: int = 0  # a longer hit existed, the policy chose to recompute
    backups_skipped: int = 0  # write-through skipped: no room could be made
    restores: int = 0
    restore_s: float = 0.0
    restore_overlapped_s: float = 0.0
    verified_pages: int = 0  # pages whose digest was checked after a transfer (verify_pages)
    verify_failures: int = 0  # transfers failed because a page's digest differed
    l3_discovered_pages: int = 0  # pages a shared store was found to hold (discover)
    l3_lost_runs: int = 0  # runs whose L3 copy a read found gone from a shared store (lose)
    l3_unavailable: int = 0  # L3 reads or backups skipped: the store was unreachable
    l3_deadline_failures: int = 0  # L3 transfers failed by their deadline
    directions: dict[str, DirectionStats] = field(default_factory=lambda: {d.name: DirectionStats() for d in Direction})
    restore_seconds: Histogram = field(default_factory=Histogram)
    transfer_seconds: dict[str, Histogram] = field(default_factory=lambda: {d.name: Histogram() for d in Direction})
    ttft_seconds: Histogram = field(default_factory=Histogram)

    def observe_restore(self, seconds: float, overlapped_s: float) -> None:
        """A restore completed after ``seconds``, ``overlapped_s`` of them beside other work."""
        self.restores += 1
        self.restore_s += seconds
        self.restore_overlapped_s += min(overlapped_s, seconds)
        self.restore_seconds.observe(seconds)

    def observe_transfer(self, direction: str, seconds: float) -> None:
        """A transfer in ``direction`` completed, ``seconds`` from issue to seen completed."""
        self.transfer_seconds[direction].observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        """A request's first token came ``seconds`` after it arrived (fed by the engine).
        MisuseError for anything but a number of seconds in [0, 1e9]: a negative one lowered
        the histogram's sum, a NaN spoiled it for good."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 1e9:
            raise MisuseError(f"observe_ttft: seconds must be a number in [0, 1e9], got {seconds!r:.60}")
        self.ttft_seconds.observe(seconds)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name, stats in self.directions.items():
            out["directions"][name]["gib_per_s"] = stats.gib_per_s
        return out

    def prometheus(self, evictions: Mapping[str, int], prefix: str = "hicache", levels: Levels | None = None) -> str:
        """The Prometheus text exposition (parses with prometheus_client's parser)."""
        from prometheus_client import CollectorRegistry, generate_latest

        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Collector(self, evictions, prefix, levels))
        return generate_latest(reg).decode()


# name, help, Metrics attribute
_COUNTERS = (
    (
        "recomputed_tokens",
        "Prompt tokens in whole pages prefilled instead of taken from a cache tier",
        "recomputed_tokens",
    ),
    ("promotions", "L3 runs promoted to L2", "promotions"),
    ("fallbacks", "Restores that failed or could not start (the request recomputed)", "fallbacks"),
    ("policy_skips", "Longer hits the policy chose not to restore", "policy_skips"),
    ("backups_skipped", "Write-through backups skipped for lack of room", "backups_skipped"),
    ("restores", "Restores completed", "restores"),
    ("restore_overlapped_seconds", "Restore seconds overlapped with other work", "restore_overlapped_s"),
    ("verified_pages", "Pages digest-checked after a transfer", "verified_pages"),
    ("verify_failures", "Transfers failed on a page digest mismatch", "verify_failures"),
    ("l3_discovered_pages", "Pages a shared L3 store was found to hold", "l3_discovered_pages"),
    ("l3_lost_runs", "Runs whose L3 copy a read found gone from a shared store", "l3_lost_runs"),
    ("l3_unavailable", "L3 reads or backups skipped because the store was unreachable", "l3_unavailable"),
    ("l3_deadline_failures", "L3 transfers failed by their deadline", "l3_deadline_failures"),
)
# name, help, DirectionStats attribute
_DIRECTION_COUNTERS = (
    ("transfers", "Transfers completed", "count"),
    ("transfers_failed", "Transfers failed or cancelled", "failed"),
    ("transfer_bytes", "Bytes moved", "bytes"),
    ("transfer_steady_seconds", "Recurring transfer seconds (one-time setup excluded)", "steady_s"),
    ("transfer_enqueue_seconds", "Seconds spent issuing transfers", "enqueue_s"),
    ("transfer_setup_seconds", "One-time workspace setup seconds", "setup_s"),
    ("transfer_queue_seconds", "Seconds waiting before service", "queue_s"),
    ("transfer_service_seconds", "Kernel/DMA or file I/O seconds", "service_s"),
    ("transfer_extents", "L3 file extents read or written", "extents"),
)


class _Collector:
    """Reads a :class:`Metrics` (and optional levels) into prometheus_client's families."""

    def __init__(self, m: Metrics, evictions: Mapping[str, int], prefix: str, levels: Levels | None) -> None:
        self.m, self.evictions, self.prefix, self.levels = m, evictions, prefix, levels

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        p, m = self.prefix, self.m
        c = CounterMetricFamily(f"{p}_hit_tokens", "Prompt tokens served from each tier", labels=["tier"])
        for tier, n in m.hit_tokens.items():
            c.add_metric([tier], n)
        yield c
        c = CounterMetricFamily(f"{p}_evicted_pages", "Pages evicted from each tier", labels=["tier"])
        for tier, n in self.evictions.items():
            c.add_metric([tier], n)
        yield c
        for name, doc, attr in _COUNTERS:
            yield CounterMetricFamily(f"{p}_{name}", doc, value=getattr(m, attr))
        for name, doc, attr in _DIRECTION_COUNTERS:
            c = CounterMetricFamily(f"{p}_{name}", doc, labels=["direction"])
            for d, stats in m.directions.items():
                c.add_metric([d], getattr(stats, attr))
            yield c
        h = HistogramMetricFamily(f"{p}_restore_seconds", "Seconds from a restore's start to its publication")
        h.add_metric([], m.restore_seconds.cumulative(), m.restore_seconds.sum)
        yield h
        h = HistogramMetricFamily(
            f"{p}_transfer_seconds", "Seconds from issuing a transfer to seeing it complete", labels=["direction"]
        )
        for d, hist in m.transfer_seconds.items():
            h.add_metric([d], hist.cumulative(), hist.sum)
        yield h
        h = HistogramMetricFamily(f"{p}_time_to_first_token_seconds", "Seconds from arrival to first token")
        h.add_metric([], m.ttft_seconds.cumulative(), m.ttft_seconds.sum)
        yield h
        lv = self.levels
        if lv is None:
            return
        for name, doc, values in (
            ("free_pages", "Free pages per tier", lv.free_pages),
            ("capacity_pages", "Pages per tier", lv.capacity_pages),
        ):
            g = GaugeMetricFamily(f"{p}_{name}", doc, labels=["tier"])
            for tier, n in values.items():
                g.add_metric([tier], n)
            yield g
        g = GaugeMetricFamily(f"{p}_pending_transfers", "Transfers in flight", labels=["kind"])
        g.add_metric(["backup"], lv.pending_backups)
        g.add_metric(["restore"], lv.pending_restores)
        yield g
        yield GaugeMetricFamily(f"{p}_requests", "Requests admitted and not released", value=lv.requests)
