"""The cost model: learning rules and the seed's decision scenarios."""

from __future__ import annotations

import pytest

from hicache.core.cost import AffineCost, CostModel, CostPriors, Policy
from hicache.errors import ConfigError
from hicache.spec.model import Direction, Tier

QWEN8B = 147_456  # bytes per token
GiB = 2**30


def test_always_picks_the_longest_hit() -> None:
    m = CostModel(QWEN8B, policy="always")
    assert m.decide(0, 1000, 3500).tier is Tier.L3
    assert m.decide(0, 3500, 3500).tier is Tier.L2
    assert m.decide(3500, 1000, 2000).tier is Tier.L1


def test_never_recomputes() -> None:
    assert CostModel(QWEN8B, policy=Policy.NEVER).decide(0, 3500, 3500).tier is Tier.L1


def test_cost_prefers_a_shorter_l2_hit_over_slow_l3() -> None:
    """Storage at 0.2 GiB/s: the extra 500 L3 tokens are not worth reading."""
    m = CostModel(QWEN8B, CostPriors(storage_read_gib_s=0.2, recompute_s_per_token=45e-6))
    plan = m.decide(0, 3000, 3500)
    assert plan.tier is Tier.L2 and plan.tokens == 3000


def test_cost_recomputes_when_that_is_cheaper() -> None:
    """Fast compute (5 µs/token) and slow storage: recompute beats L3."""
    m = CostModel(QWEN8B, CostPriors(storage_read_gib_s=1.0, recompute_s_per_token=5e-6))
    assert m.decide(0, 0, 3500).tier is Tier.L1


def test_cost_restores_from_l3_when_storage_is_fast_and_compute_slow() -> None:
    m = CostModel(QWEN8B, CostPriors(storage_read_gib_s=11.0, recompute_s_per_token=138e-6))
    plan = m.decide(0, 0, 3500)
    assert plan.tier is Tier.L3 and plan.benefit_s > 0


def test_prefill_observations_move_the_recompute_prior() -> None:
    """Prior 50 µs/token: an L3 restore of 3,500 tokens (84 ms at 11 GiB/s + H2D) beats
    recompute (175 ms). Prefills observed at 5 µs/token + 2 ms flip it to recompute."""
    m = CostModel(QWEN8B, CostPriors(storage_read_gib_s=11.0))
    assert m.decide(0, 0, 3500).tier is Tier.L3
    for n in (500, 1000, 2000, 3000, 3500, 800):
        m.observe_prefill(n, n * 5e-6 + 0.002)
    assert m.recompute.slope == pytest.approx(5e-6, rel=1e-6)
    assert m.recompute.fixed == pytest.approx(0.002, rel=1e-6)
    assert m.decide(0, 0, 3500).tier is Tier.L1


def test_affine_fit_learns_the_crossover() -> None:
    """From mixed sizes the model learns a restore of 30 ms + 13.7 µs/token exactly; with
    recompute at 40 µs/token, 500 tokens recompute (20 < 37 ms) and 3,500 restore (140 > 78 ms)."""
    m = CostModel(QWEN8B, CostPriors(recompute_s_per_token=40e-6))
    fixed, bw = 0.030, 10 * GiB
    for tokens in (100, 400, 900, 1600, 2500, 3600):
        m.observe_transfer(Direction.H2D, tokens * QWEN8B, fixed + tokens * QWEN8B / bw)
    h2d = m.transfer[Direction.H2D]
    assert h2d.fixed == pytest.approx(fixed, rel=1e-6) and h2d.slope == pytest.approx(1 / bw, rel=1e-6)
    assert m.decide(0, 500, 0).tier is Tier.L1
    long = m.decide(0, 3500, 0)
    assert long.tier is Tier.L2 and long.predicted_restore_s == pytest.approx(fixed + 3500 * QWEN8B / bw)


def test_slow_write_does_not_disturb_the_read_model() -> None:
    m = CostModel(QWEN8B)
    read_before = m.transfer[Direction.S2H].predict(10**9)
    for _ in range(10):
        m.observe_transfer(Direction.H2S, 10**8, 5.0)  # a terribly slow disk write
    assert m.transfer[Direction.S2H].predict(10**9) == read_before
    assert m.transfer[Direction.H2S].predict(10**8) > 1.0


def test_one_size_learns_fixed_cost_by_ewma_of_positive_residuals() -> None:
    a = AffineCost(prior_slope=1e-3)
    for _ in range(50):
        a.observe(100, 0.1 + 0.02)  # residual 0.02 s above the prior line
    assert a.slope == 1e-3 and a.fixed == pytest.approx(0.02, rel=1e-3)
    b = AffineCost(prior_slope=1e-3)
    b.observe(100, 0.05)  # faster than the prior: negative residual -> fixed stays 0
    assert b.fixed == 0.0


def test_negative_fits_are_clamped() -> None:
    a = AffineCost(prior_slope=1.0)
    for x, t in ((10, 5.0), (20, 4.0), (30, 3.0)):
        a.observe(x, t)
    assert a.slope == 0.0 and a.fixed == pytest.approx(4.0)
    b = AffineCost(prior_slope=1.0)
    for x, t in ((10, 0.5), (20, 2.0), (30, 3.5)):  # intercept would be negative
        b.observe(x, t)
    assert b.fixed == 0.0 and b.slope > 0


def test_window_is_32() -> None:
    a = AffineCost(prior_slope=1.0)
    for i in range(100):
        a.observe(1 + i, float(i))
    assert len(a.samples) == 32


@pytest.mark.parametrize("bad", [{"host_gib_s": 0}, {"margin": -1}, {"recompute_s_per_token": float("nan")}])
def test_bad_priors_raise(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        CostPriors(**bad)


def test_unknown_policy_raises() -> None:
    with pytest.raises(ConfigError, match="policy"):
        CostModel(QWEN8B, policy="sometimes")
