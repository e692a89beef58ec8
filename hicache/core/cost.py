"""The online cost model: restore or recompute, per request (DESIGN.md §7).

For ``n`` reusable tokens at ``b`` bytes per token::

    C_recompute(n) = f_r + n * s_r                          (learned from prefills)
    saved(n)       = n * s_r
    C_L2(n)        = f_h2d + n * b / bw_h2d
    C_L3(n)        = f_s2h + n_s * b / bw_s2h + C_L2(n)      (n_s: tokens not already in L2)

The candidate (L1 only, L2, L3) with the largest positive ``saved - margin * C_restore``
wins. Each term is an :class:`AffineCost` learned online from recurring transfer times (and,
for recompute, from the engine's prefill timings).

NOTE: the design contract writes the benefit as ``C_recompute(n) - margin * C_restore``. A restored
request still prefills its tail (at least its last token), so it pays the fixed cost ``f_r``
either way: a restore saves ``n * s_r``, not ``f_r + n * s_r``. Counting ``f_r`` leans every
close call toward restoring, which loses when the source is slow (a cold disk).

More departures from the contract (DESIGN.md §7 lists them), all for the ``n * s_r`` rule,
which needs the slope itself:

- The fixed cost and the slope are fitted only once the window's sizes span a factor of two
  (smallest <= largest / 2): over a narrower span, timing noise decides the slope, and a
  slope near 0 would say restores save nothing. Within that, a signed EWMA of residuals:
  the contract's positive-only one could learn that a source is slower than its prior, never
  that it is faster.
- A negative fitted slope leaves the recompute model at its prior slope (transfers keep
  the contract's (mean, 0)): one slow outlier prefill (a graph capture) can tilt the fit negative,
  and a slope of 0 would say restores save nothing.
- Two strikes for far-off samples (:class:`AffineCost`): one more than 10x the prediction
  (and by over 50 ms) waits for the next sample to confirm it. One compile inside a timed
  copy (~1 s against ~2 ms) would otherwise rule restores out for good, and a model that
  never restores never learns otherwise.
- Exploration: a source whose read direction has fewer than ``explore`` samples is tried
  (at most ``explore`` times) when no candidate wins on the priors, provided its predicted
  restore costs at most twice what it saves. Priors can be wrong by 2x (page-cached storage
  reads at 5-7 GiB/s against the 3 GiB/s prior) and a model that never restores never learns.
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

    While the window's sizes barely differ (smallest > largest / 2, or all within 1) the two
    terms cannot both be identified: the residual against the prior line is tracked as an
    EWMA (alpha 0.2, seeded by the first sample). A positive one is the fixed cost (slope at
    its prior); a negative one lowers the slope (fixed 0), so that a source faster than its
    prior is learned too. Once sizes differ, both come from a least-squares fit constrained
    non-negative (negative slope -> (mean, 0); negative intercept -> a fit through the origin).
    """

    prior_slope: float
    fixed: float = 0.0
    window: int = 32
    # Two strikes: a sample more than ``outlier_ratio`` times the prediction, and by more
    # than ``outlier_min_s``, is held back until the next sample agrees (both enter) or not
    # (it is dropped). One compile inside a timed copy (~1 s against ~2 ms) would otherwise
    # rule restores out for good: the model would never restore again, so never learn.
    outlier_ratio: float = 10.0
    outlier_min_s: float = 0.05
    # A negative fitted slope: the contract says (mean, 0). For recompute, whose slope is
    # what a restore saves, a slope of 0 would say restores save nothing; it keeps its prior.
    negative_keeps_prior: bool = False
    slope: float = field(init=False)
    samples: deque[tuple[float, float]] = field(init=False)

    def __post_init__(self) -> None:
        if not self.prior_slope >= 0 or not self.fixed >= 0:
            raise ConfigError(f"cost priors must be non-negative, got slope={self.prior_slope} fixed={self.fixed}")
        self.slope = self.prior_slope
        self.samples = deque(maxlen=self.window)
        self._residual = self.fixed
        self.held: tuple[float, float] | None = None  # a far-off sample awaiting a second
        self.dropped = 0  # far-off samples the next one did not confirm

    def predict(self, size: float) -> float:
        return self.fixed + size * self.slope if size > 0 else 0.0

    def marginal(self, size: float) -> float:
        """Seconds that ``size`` more units add to an operation paid anyway (no fixed cost)."""
        return size * self.slope if size > 0 else 0.0

    def observe(self, size: float, seconds: float) -> None:
        if size <= 0 or seconds < 0:
            return
        predicted = self.predict(size)
        if seconds > self.outlier_ratio * predicted and seconds - predicted > self.outlier_min_s:
            if self.held is None:
                self.held = (size, seconds)
                return
            self._add(*self.held)  # a second one: the source really is that slow
        elif self.held is not None:
            self.dropped += 1
        self.held = None
        self._add(size, seconds)

    def _add(self, size: float, seconds: float) -> None:
        self.samples.append((size, seconds))
        sizes = [s for s, _ in self.samples]
        largest = max(sizes)
        spread = largest - min(sizes)
        if spread <= 1.0 or spread < 0.5 * largest:  # barely differ: smallest > largest / 2
            residual = seconds - size * self.prior_slope
            r = self._residual = residual if len(sizes) == 1 else _ewma(self._residual, residual)
            if r >= 0:
                self.fixed, self.slope = r, self.prior_slope
            else:
                self.fixed, self.slope = 0.0, max(0.0, self.prior_slope + r / (sum(sizes) / len(sizes)))
            return
        n = len(self.samples)
        mean_x = sum(sizes) / n
        mean_y = sum(t for _, t in self.samples) / n
        var = sum((x - mean_x) ** 2 for x in sizes)
        cov = sum((x - mean_x) * (t - mean_y) for x, t in self.samples)
        slope = cov / var
        if slope < 0:
            if self.negative_keeps_prior:
                self.fixed, self.slope = max(0.0, mean_y - self.prior_slope * mean_x), self.prior_slope
            else:
                self.fixed, self.slope = max(0.0, mean_y), 0.0
            return
        fixed = mean_y - slope * mean_x
        if fixed < 0:
            slope = sum(x * t for x, t in self.samples) / sum(x * x for x in sizes)
            fixed = 0.0
        self.fixed, self.slope = fixed, slope

    def state(self) -> dict[str, float]:
        return {
            "fixed_s": self.fixed,
            "slope": self.slope,
            "samples": float(len(self.samples)),
            "held": float(self.held is not None),
            "dropped": float(self.dropped),
        }


_MAX_PRIOR = 1e300


@dataclass(frozen=True, slots=True)
class CostPriors:
    """Priors of the model (configurable): recompute 50 µs/token, host 12 GiB/s, storage
    read 3 GiB/s (writes: the same bandwidths until learned); ``explore``: restores tried
    per source before its priors alone may rule it out (0: never explore)."""

    recompute_s_per_token: float = 50e-6
    host_gib_s: float = 12.0
    storage_read_gib_s: float = 3.0
    storage_write_gib_s: float = 3.0
    margin: float = 1.0
    explore: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.explore, bool) or not isinstance(self.explore, int) or self.explore < 0:
            raise ConfigError(f"cost prior explore must be an int >= 0, got {self.explore!r}")
        for name in ("recompute_s_per_token", "host_gib_s", "storage_read_gib_s", "storage_write_gib_s", "margin"):
            value = getattr(self, name)
            # NOTE: a finite float's range: an int past it overflowed when the model was built
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= _MAX_PRIOR:
                raise ConfigError(f"cost prior {name} must be a positive number up to 1e300, got {value!r:.60}")


@dataclass(frozen=True, slots=True)
class Plan:
    """Where to restore from (``Tier.L1``: nothing to restore, recompute the rest)."""

    tier: Tier
    tokens: int  # the prefix length usable after the restore
    benefit_s: float  # predicted seconds saved: recompute saved - margin * restore (0 for L1)
    predicted_restore_s: float
    predicted_recompute_s: float  # recompute the restore saves: n * s_r (the tail's f_r is paid anyway)
    explore: bool = False  # chosen to learn this source's cost, not on predicted benefit


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
        self.recompute = AffineCost(p.recompute_s_per_token, negative_keeps_prior=True)
        self.transfer = {
            Direction.H2D: AffineCost(1 / (p.host_gib_s * GiB)),
            Direction.D2H: AffineCost(1 / (p.host_gib_s * GiB)),
            Direction.S2H: AffineCost(1 / (p.storage_read_gib_s * GiB)),
            Direction.H2S: AffineCost(1 / (p.storage_write_gib_s * GiB)),
        }
        self.explored = {Tier.L2: 0, Tier.L3: 0}

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
            recompute = self.recompute.marginal(n - n1)
            return Plan(tier, n, recompute - self.priors.margin * restore, restore, recompute)
        best = Plan(Tier.L1, n1, 0.0, 0.0, 0.0)
        trial: Plan | None = None
        for tier, n in candidates:
            if n <= n1:
                continue
            restore = self.restore_cost(tier, n1, n2, n3, n)
            recompute = self.recompute.marginal(n - n1)
            benefit = recompute - self.priors.margin * restore
            if benefit > best.benefit_s:
                best = Plan(tier, n, benefit, restore, recompute)
            elif trial is None and self._unlearned(tier) and restore <= 2 * recompute:
                trial = Plan(tier, n, benefit, restore, recompute, explore=True)
        if best.tier is Tier.L1 and trial is not None:
            self.explored[trial.tier] += 1
            return trial
        return best

    def _unlearned(self, tier: Tier) -> bool:
        """Whether ``tier``'s read direction has too few samples, and exploring it is allowed."""
        read = self.transfer[Direction.H2D if tier is Tier.L2 else Direction.S2H]
        return self.explored[tier] < self.priors.explore and len(read.samples) < self.priors.explore

    def state(self) -> dict[str, Any]:
        return {
            "policy": self.policy.value,
            "margin": self.priors.margin,
            "explored": {t.name: k for t, k in self.explored.items()},
            "recompute": self.recompute.state(),
            **{d.name: m.state() for d, m in self.transfer.items()},
        }
