"""The online cost model: restore or recompute, per request (DESIGN.md §7).

For ``n`` reusable tokens at ``b`` bytes per token::

    C_recompute(n) = f_r + n * s_r
    C_L2(n)        = f_h2d + n * b / bw_h2d
    C_L3(n)        = f_s2h + n_s * b / bw_s2h + C_L2(n)      (n_s: tokens not already in L2)

The candidate (L1 only, L2, L3) with the largest positive ``C_recompute - margin * C_restore``
wins. Each term is an :class:`AffineCost` learned online from recurring transfer times (and,
for recompute, from the engine's prefill timings).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hicache.errors import ConfigError
from hicache.spec.model import Direction, Tier

GiB = float(2**30)


class Policy(StrEnum):
    COST = "cost"  # the model decides (default)
    ALWAYS = "always"  # the longest hit wins
    NEVER = "never"  # never restore: the recompute baseline


def _ewma(previous: float, sample: float, alpha: float = 0.2) -> float:
    return previous * (1 - alpha) + sample * alpha


@dataclass
class AffineCost:
    """``seconds = fixed + size * slope``, learned from a window of ``(size, seconds)``.

    While the window's sizes barely differ (spread <= max(1, 5% of the largest)) the two
    terms cannot both be identified: the slope keeps its prior and the fixed cost follows
    an EWMA (alpha 0.2) of the positive residuals. Once sizes differ, both come from a
    least-squares fit constrained non-negative (negative slope -> (mean, 0); negative
    intercept -> a fit through the origin).
    """

    prior_slope: float
    fixed: float = 0.0
    window: int = 32
    slope: float = field(init=False)
    samples: deque[tuple[float, float]] = field(init=False)

    def __post_init__(self) -> None:
        if not self.prior_slope >= 0 or not self.fixed >= 0:
            raise ConfigError(f"cost priors must be non-negative, got slope={self.prior_slope} fixed={self.fixed}")
        self.slope = self.prior_slope
        self.samples = deque(maxlen=self.window)

    def predict(self, size: float) -> float:
        return self.fixed + size * self.slope if size > 0 else 0.0

    def observe(self, size: float, seconds: float) -> None:
        if size <= 0 or seconds < 0:
            return
        self.samples.append((size, seconds))
        sizes = [s for s, _ in self.samples]
        largest = max(sizes)
        if largest - min(sizes) <= max(1.0, 0.05 * largest):
            self.slope = self.prior_slope
            self.fixed = _ewma(self.fixed, max(0.0, seconds - size * self.slope))
            return
        n = len(self.samples)
        mean_x = sum(sizes) / n
        mean_y = sum(t for _, t in self.samples) / n
        var = sum((x - mean_x) ** 2 for x in sizes)
        cov = sum((x - mean_x) * (t - mean_y) for x, t in self.samples)
        slope = cov / var
        if slope < 0:
            self.fixed, self.slope = max(0.0, mean_y), 0.0
            return
        fixed = mean_y - slope * mean_x
        if fixed < 0:
            slope = sum(x * t for x, t in self.samples) / sum(x * x for x in sizes)
            fixed = 0.0
        self.fixed, self.slope = fixed, slope

    def state(self) -> dict[str, float]:
        return {"fixed_s": self.fixed, "slope": self.slope, "samples": float(len(self.samples))}


@dataclass(frozen=True, slots=True)
class CostPriors:
    """Priors of the model (configurable): recompute 50 µs/token, host 12 GiB/s, storage
    read 3 GiB/s (writes: the same bandwidths until learned)."""

    recompute_s_per_token: float = 50e-6
    host_gib_s: float = 12.0
    storage_read_gib_s: float = 3.0
    storage_write_gib_s: float = 3.0
    margin: float = 1.0

    def __post_init__(self) -> None:
        for name in ("recompute_s_per_token", "host_gib_s", "storage_read_gib_s", "storage_write_gib_s", "margin"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"cost prior {name} must be positive, got {value!r}")


@dataclass(frozen=True, slots=True)
class Plan:
    """Where to restore from (``Tier.L1``: nothing to restore, recompute the rest)."""

    tier: Tier
    tokens: int  # the prefix length usable after the restore
    benefit_s: float  # predicted recompute seconds saved (0 for L1)
    predicted_restore_s: float
    predicted_recompute_s: float


class CostModel:
    """One affine model per transfer direction, one for recompute, and the decision rule."""

    def __init__(
        self, bytes_per_token: int, priors: CostPriors | None = None, policy: Policy | str = Policy.COST
    ) -> None:
        try:
            self.policy = Policy(policy)
        except ValueError:
            raise ConfigError(f"policy must be one of {[p.value for p in Policy]}, got {policy!r}") from None
        if bytes_per_token <= 0:
            raise ConfigError(f"bytes_per_token must be positive, got {bytes_per_token}")
        self.priors = p = priors or CostPriors()
        self.bytes_per_token = bytes_per_token
        self.recompute = AffineCost(p.recompute_s_per_token)
        self.transfer = {
            Direction.H2D: AffineCost(1 / (p.host_gib_s * GiB)),
            Direction.D2H: AffineCost(1 / (p.host_gib_s * GiB)),
            Direction.S2H: AffineCost(1 / (p.storage_read_gib_s * GiB)),
            Direction.H2S: AffineCost(1 / (p.storage_write_gib_s * GiB)),
        }

    def observe_transfer(self, direction: Direction, nbytes: int, seconds: float) -> None:
        """A completed transfer's recurring time (one-time setup excluded)."""
        self.transfer[direction].observe(nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """An engine prefill of ``tokens`` new tokens took ``seconds``."""
        self.recompute.observe(tokens, seconds)

    def restore_cost(self, tier: Tier, n1: int, n2: int, n3: int, target: int) -> float:
        """Seconds to make ``target`` tokens usable in L1 by restoring from ``tier``."""
        b = self.bytes_per_token
        h2d = self.transfer[Direction.H2D].predict((target - n1) * b)
        if tier is Tier.L2:
            return h2d
        return self.transfer[Direction.S2H].predict(max(0, target - max(n1, n2)) * b) + h2d

    def decide(self, n1: int, n2: int, n3: int) -> Plan:
        """Pick the restore source for a prompt whose per-tier hits are ``n1, n2, n3``."""
        candidates = [(Tier.L2, n2), (Tier.L3, n3)]
        if self.policy is Policy.NEVER:
            return Plan(Tier.L1, n1, 0.0, 0.0, 0.0)
        if self.policy is Policy.ALWAYS:
            tier, n = max(candidates, key=lambda c: (c[1], c[0] is Tier.L2))
            if n <= n1:
                return Plan(Tier.L1, n1, 0.0, 0.0, 0.0)
            restore = self.restore_cost(tier, n1, n2, n3, n)
            recompute = self.recompute.predict(n - n1)
            return Plan(tier, n, recompute - restore, restore, recompute)
        best = Plan(Tier.L1, n1, 0.0, 0.0, 0.0)
        for tier, n in candidates:
            if n <= n1:
                continue
            restore = self.restore_cost(tier, n1, n2, n3, n)
            recompute = self.recompute.predict(n - n1)
            benefit = recompute - self.priors.margin * restore
            if benefit > best.benefit_s:
                best = Plan(tier, n, benefit, restore, recompute)
        return best

    def state(self) -> dict[str, Any]:
        return {
            "policy": self.policy.value,
            "margin": self.priors.margin,
            "recompute": self.recompute.state(),
            **{d.name: m.state() for d, m in self.transfer.items()},
        }
