"""The cost model: learning rules and the seed's decision scenarios."""

from __future__ import annotations

from typing import Any

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


def test_the_tail_prefills_fixed_cost_is_not_a_benefit() -> None:
    """Recompute learned as 12 ms + 20 µs/token. An L3 restore of 350 tokens at 4 GiB/s
    takes ~13 ms; recomputing them adds only 7 ms to the tail's prefill, whose 12 ms fixed
    cost is paid either way. Recompute wins (counting f_r, 19 ms > 13 ms, would restore)."""
    m = CostModel(QWEN8B, CostPriors(storage_read_gib_s=4.0, host_gib_s=46.0, explore=0))
    for n in (16, 350, 32, 700, 16, 350):
        m.observe_prefill(n, 0.012 + n * 20e-6)
    restore = m.restore_cost(Tier.L3, 0, 0, 350, 350)
    assert m.recompute.marginal(350) < restore < m.recompute.predict(350)  # the close call
    assert m.decide(0, 0, 350).tier is Tier.L1
    # 3,500 tokens save 70 ms against a ~131 ms read at 4 GiB/s: still recompute; from page
    # cache (11 GiB/s, ~54 ms) the restore wins and its saving is n * s_r
    assert m.decide(0, 0, 3500).tier is Tier.L1
    fast = CostModel(QWEN8B, CostPriors(storage_read_gib_s=11.0, host_gib_s=46.0))
    for n in (16, 350, 32, 700, 16, 350):
        fast.observe_prefill(n, 0.012 + n * 20e-6)
    plan = fast.decide(0, 0, 3500)
    assert plan.tier is Tier.L3 and plan.predicted_recompute_s == pytest.approx(3500 * 20e-6)


def _rotation_prefills(m: CostModel) -> None:
    """Full prefills of 350-374 tokens at 12 ms + 55 µs/token, with a little noise: sizes
    within a factor of two, so the slope keeps its prior (a fit here gave 0 from noise)."""
    for i in range(32):
        n = 350 + (7 * i) % 25
        m.observe_prefill(n, 0.012 + n * 55e-6 + (0.002 if i % 3 == 0 else -0.001))


def test_similar_sizes_keep_the_slope_prior() -> None:
    m = CostModel(QWEN8B, CostPriors(recompute_s_per_token=50e-6))
    _rotation_prefills(m)
    assert m.recompute.slope == 50e-6 and m.recompute.fixed > 0.01


def test_an_unlearned_source_is_explored_then_judged_by_what_was_learned() -> None:
    """Storage prior 3 GiB/s: restoring 350 tokens from L3 (~20 ms) looks worse than the
    17.5 ms it saves, so on priors alone the model would never read L3 and never learn."""
    fast = CostModel(QWEN8B)
    _rotation_prefills(fast)
    first = fast.decide(0, 0, 350)
    assert first.tier is Tier.L3 and first.explore and first.benefit_s < 0
    nbytes = 350 * QWEN8B
    for _ in range(2):  # page-cached storage: 6 GiB/s
        fast.observe_transfer(Direction.S2H, nbytes, nbytes / (6 * GiB))
        fast.observe_transfer(Direction.H2D, nbytes, nbytes / (40 * GiB))
    learned = fast.decide(0, 0, 350)
    assert learned.tier is Tier.L3 and not learned.explore and learned.benefit_s > 0

    slow = CostModel(QWEN8B)
    _rotation_prefills(slow)
    tried = [slow.decide(0, 0, 350) for _ in range(2)]
    assert all(p.tier is Tier.L3 and p.explore for p in tried)
    assert slow.decide(0, 0, 350).tier is Tier.L1  # tried twice, nothing learned: no more
    for _ in range(2):  # a cold disk: 1.4 GiB/s
        slow.observe_transfer(Direction.S2H, nbytes, nbytes / (1.4 * GiB))
    assert slow.decide(0, 0, 350).tier is Tier.L1
    assert slow.explored == {Tier.L2: 0, Tier.L3: 2}


def test_exploration_is_bounded_by_twice_the_saving() -> None:
    m = CostModel(QWEN8B, CostPriors(storage_read_gib_s=0.5))  # restore ~100 ms vs 17.5 saved
    _rotation_prefills(m)
    assert m.decide(0, 0, 350).tier is Tier.L1 and m.explored[Tier.L3] == 0
    off = CostModel(QWEN8B, CostPriors(explore=0))
    _rotation_prefills(off)
    assert off.decide(0, 0, 350).tier is Tier.L1


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


def test_one_size_learns_from_the_residual_both_ways() -> None:
    a = AffineCost(prior_slope=1e-3)
    for _ in range(50):
        a.observe(100, 0.1 + 0.02)  # residual 0.02 s above the prior line
    assert a.slope == 1e-3 and a.fixed == pytest.approx(0.02, rel=1e-3)
    b = AffineCost(prior_slope=1e-3)
    b.observe(100, 0.05)  # faster than the prior: negative residual -> fixed 0, lower slope
    assert b.fixed == 0.0 and b.predict(100) == pytest.approx(0.05)
    b.observe(100, 0.1)  # back at the prior line: the EWMA moves a fifth of the way
    assert b.fixed == 0.0 and b.predict(100) == pytest.approx(0.06)


def test_sizes_within_one_of_each_other_keep_the_slope_prior() -> None:
    """Sizes 1 and 2 (all within 1) cannot identify both terms: the slope stays at its prior
    and the residual's EWMA becomes the fixed cost, however steep the two samples look."""
    a = AffineCost(prior_slope=1.0)
    a.observe(1, 1.0)  # on the prior line: residual 0
    a.observe(2, 5.0)  # residual 3: the EWMA moves a fifth of the way
    assert a.slope == 1.0 and a.fixed == pytest.approx(0.6)


def test_sizes_a_factor_of_two_apart_are_fitted() -> None:
    """Sizes 100 and 200 span a factor of two (smallest = largest / 2): both terms come from
    the fit (slope 0.02, fixed 1), not from the prior; 101 and 200 still barely differ."""
    a = AffineCost(prior_slope=1.0)
    a.observe(100, 3.0)
    a.observe(200, 5.0)
    assert a.slope == pytest.approx(0.02) and a.fixed == pytest.approx(1.0)
    b = AffineCost(prior_slope=1.0)
    b.observe(101, 150.0)  # residual 49: seeds the EWMA
    b.observe(200, 300.0)  # residual 100: a fifth of the way (a fit would give slope 1.515)
    assert b.slope == 1.0 and b.fixed == pytest.approx(59.2)


def test_negative_fits_are_clamped() -> None:
    a = AffineCost(prior_slope=1.0)
    for x, t in ((10, 5.0), (20, 4.0), (30, 3.0)):
        a.observe(x, t)
    assert a.slope == 0.0 and a.fixed == pytest.approx(4.0)
    b = AffineCost(prior_slope=1.0)
    for x, t in ((10, 0.5), (20, 2.0), (30, 3.5)):  # intercept would be negative
        b.observe(x, t)
    assert b.fixed == 0.0 and b.slope > 0


def test_an_outlier_cannot_make_recompute_free() -> None:
    """One slow small prefill (a graph capture, a first kernel load) among full ones fits a
    negative slope; the recompute model keeps its prior slope instead of 0, so a restore
    still saves n * s_r."""
    m = CostModel(QWEN8B)
    m.observe_prefill(22, 0.5)
    for _ in range(31):
        m.observe_prefill(358, 0.030)
    assert m.recompute.slope == 50e-6 and m.recompute.fixed > 0
    assert m.decide(0, 336, 0).tier is Tier.L2
    t = AffineCost(prior_slope=1.0)  # transfers keep §7's rule: (mean, 0)
    for x, sec in ((10, 5.0), (20, 4.0), (30, 3.0)):
        t.observe(x, sec)
    assert t.slope == 0.0


def test_a_far_off_sample_waits_for_a_second_before_it_counts() -> None:
    """A restore's first copy that held a ~1 s compile must not rule L2 out: the next,
    normal copy drops it. A source that really is that slow counts from its second sample."""
    m = CostModel(QWEN8B)
    _rotation_prefills(m)
    nbytes = 350 * QWEN8B
    m.observe_transfer(Direction.H2D, nbytes, 1.0)  # a compile inside the timed copy
    h2d = m.transfer[Direction.H2D]
    assert h2d.state()["held"] == 1 and not h2d.samples
    assert m.decide(0, 350, 0).tier is Tier.L2
    m.observe_transfer(Direction.H2D, nbytes, nbytes / (40 * GiB))
    assert h2d.state()["held"] == 0 and h2d.dropped == 1 and len(h2d.samples) == 1
    assert h2d.predict(nbytes) == pytest.approx(nbytes / (40 * GiB)) and m.decide(0, 350, 0).tier is Tier.L2

    slow = CostModel(QWEN8B)
    _rotation_prefills(slow)
    for _ in range(2):
        slow.observe_transfer(Direction.H2D, nbytes, 1.0)
    read = slow.transfer[Direction.H2D]
    assert list(read.samples) == [(nbytes, 1.0)] * 2 and read.dropped == 0
    assert slow.decide(0, 350, 0).tier is Tier.L1


def test_a_far_off_sample_needs_both_the_ratio_and_the_excess() -> None:
    """A few milliseconds over a sub-millisecond prediction is noise, not an outlier."""
    a = AffineCost(prior_slope=1e-6)
    a.observe(100, 0.02)  # 200x the 0.1 ms prediction, but only 20 ms over it
    assert a.held is None and len(a.samples) == 1


def test_window_is_32() -> None:
    a = AffineCost(prior_slope=1.0)
    for i in range(100):
        a.observe(1 + i, float(i))
    assert len(a.samples) == 32


@pytest.mark.parametrize(
    "bad",
    [{"host_gib_s": 0}, {"margin": -1}, {"recompute_s_per_token": float("nan")}, {"explore": -1}, {"explore": 1.5}],
)
def test_bad_priors_raise(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        CostPriors(**bad)


@pytest.mark.parametrize("bad", [0, -8])
def test_a_non_positive_bytes_per_token_is_a_config_error_naming_it(bad: int) -> None:
    """The refusal names the field and the value given."""
    with pytest.raises(ConfigError, match=f"^bytes_per_token must be positive, got {bad}$"):
        CostModel(bad)


def test_unknown_policy_raises() -> None:
    with pytest.raises(ConfigError, match="policy"):
        CostModel(QWEN8B, policy="sometimes")


def test_always_prices_only_the_tokens_past_the_l1_hit() -> None:
    """A plan's recompute saving counts the tokens past the L1 hit (restoring 64 over a 16
    hit saves what recomputing 48 costs), and its restore cost is the model's for that tier."""
    m = CostModel(QWEN8B, policy="always")
    over_hit = m.decide(16, 64, 0)
    cold = m.decide(0, 48, 0)
    assert over_hit.tier is cold.tier is Tier.L2
    assert over_hit.predicted_recompute_s == pytest.approx(cold.predicted_recompute_s)
    assert over_hit.predicted_restore_s == pytest.approx(m.restore_cost(Tier.L2, 16, 64, 0, 64))
    from_l3 = m.decide(0, 16, 64)
    assert from_l3.tier is Tier.L3
    assert from_l3.predicted_restore_s == pytest.approx(m.restore_cost(Tier.L3, 0, 16, 64, 64))


def test_cost_keeps_the_l1_hit_when_nothing_beats_it() -> None:
    """Under the cost policy, a prompt with nothing worth restoring keeps its L1 hit: the
    plan is L1 at exactly that length."""
    m = CostModel(QWEN8B, CostPriors(storage_read_gib_s=0.001, explore=0))
    plan = m.decide(32, 0, 48)
    assert (plan.tier, plan.tokens) == (Tier.L1, 32)


def test_each_direction_starts_at_its_prior_rate() -> None:
    """Before any sample, moving 1 GiB takes 1 / rate seconds in each direction (host rate
    for H2D and D2H, the storage rates for S2H and H2S), and recompute its per-token prior."""
    p = CostPriors(host_gib_s=8.0, storage_read_gib_s=2.0, storage_write_gib_s=4.0)
    m = CostModel(1024, priors=p)
    gib = 2**30
    want = {Direction.H2D: 1 / 8, Direction.D2H: 1 / 8, Direction.S2H: 1 / 2, Direction.H2S: 1 / 4}
    assert {d: m.transfer[d].predict(gib) for d in want} == pytest.approx(want)
    assert m.recompute.predict(100) == pytest.approx(100 * p.recompute_s_per_token)


def test_the_recompute_model_keeps_its_prior_slope_on_a_falling_fit() -> None:
    """A window where bigger prefills look faster fits a negative slope: the recompute model
    (what a restore saves per token) keeps its prior instead of 0; a transfer model takes 0."""
    m = CostModel(1024)
    for tokens, seconds in ((100, 0.5), (200, 0.4), (300, 0.3)):
        m.observe_prefill(tokens, seconds)
        m.observe_transfer(Direction.H2D, tokens, seconds)
    assert m.recompute.slope == m.priors.recompute_s_per_token
    assert m.transfer[Direction.H2D].slope == 0.0


def test_a_sample_ten_times_the_prediction_but_close_in_seconds_is_kept() -> None:
    """The outlier hold needs both: more than ``outlier_ratio`` times the prediction AND more
    than ``outlier_min_s`` above it. 50 ms against a 4 ms prediction is 12.5x but only 46 ms
    above: it is learned at once, not held back."""
    a = AffineCost(prior_slope=1e-3)  # 4 units -> 4 ms
    a.observe(4, 0.05)
    assert a.held is None
    assert list(a.samples) == [(4, 0.05)]
    b = AffineCost(prior_slope=1e-3)
    b.observe(4, 0.06)  # 56 ms above: held until a second sample agrees
    assert (b.held, len(b.samples)) == ((4, 0.06), 0)
