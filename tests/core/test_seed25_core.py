"""Contracts of the core's small parts that the seed-25 mutation draw found unchecked: best
fit in the allocator, the cost model's outlier and fit rules, tier sizes, histograms."""

from __future__ import annotations

import pytest

from hicache.core.allocator import PageAllocator
from hicache.core.cost import AffineCost
from hicache.core.geometry import TierSizes
from hicache.core.metrics import Histogram
from hicache.errors import ConfigError


def test_allocate_takes_an_exact_fit_before_a_longer_run() -> None:
    """With free runs [0, 2) and [5, 10), two pages come from the run of exactly two (best
    fit), leaving the long run whole."""
    pages: PageAllocator[int] = PageAllocator(10)
    first = pages.allocate(2)
    assert first == [0, 1]
    assert pages.allocate(3) == [2, 3, 4]
    pages.free(first)
    assert pages.runs() == [(0, 2), (5, 5)]
    assert pages.allocate(2) == [0, 1]
    assert pages.runs() == [(5, 5)]


def test_a_sample_exactly_outlier_min_s_above_the_prediction_is_not_held() -> None:
    """Two strikes apply to samples *more* than ``outlier_min_s`` above the prediction: one
    exactly that far above (and past the ratio) enters the window at once."""
    # Dyadic values: the prediction is 0.25 and the excess exactly 1.0 in binary floats.
    model = AffineCost(prior_slope=1 / 32, outlier_ratio=4.0, outlier_min_s=1.0)
    assert model.predict(8) == 0.25
    model.observe(8, 1.25)
    assert model.held is None
    assert list(model.samples) == [(8, 1.25)]


def test_a_far_off_sample_past_both_thresholds_is_held() -> None:
    """The counterpart: a sample past the ratio and more than ``outlier_min_s`` above the
    prediction waits for a second one."""
    model = AffineCost(prior_slope=1 / 32, outlier_ratio=4.0, outlier_min_s=1.0)
    model.observe(8, 1.5)
    assert not model.samples
    assert model.held == (8, 1.5)


def test_a_flat_fit_is_taken_by_the_recompute_model() -> None:
    """A fitted slope of exactly 0 is not negative: even the recompute model (which keeps its
    prior on a negative slope) takes the fit (mean, 0)."""
    model = AffineCost(prior_slope=0.25, negative_keeps_prior=True)
    model.observe(1, 1.0)
    model.observe(4, 1.0)
    assert (model.fixed, model.slope) == (1.0, 0.0)


def test_a_negative_fit_keeps_the_prior_slope_through_the_mean() -> None:
    """A negative fitted slope leaves the recompute model at its prior slope, with the fixed
    cost that puts the line through the samples' mean: mean_y - prior * mean_x."""
    model = AffineCost(prior_slope=0.25, negative_keeps_prior=True)
    model.observe(2, 3.0)
    model.observe(8, 2.0)  # mean (5, 2.5), slope negative
    assert (model.fixed, model.slope) == (2.5 - 0.25 * 5, 0.25)


def test_state_reports_every_field_by_name() -> None:
    """state() names exactly fixed_s, slope, samples, held and dropped, with their values."""
    model = AffineCost(prior_slope=0.25)
    model.observe(2, 3.0)
    model.observe(8, 2.0)
    assert model.state() == {"fixed_s": model.fixed, "slope": model.slope, "samples": 2.0, "held": 0.0, "dropped": 0.0}


@pytest.mark.parametrize("field", ["l2_pages", "l3_pages"])
@pytest.mark.parametrize("value", [True, 1.5, -1])
def test_tier_sizes_refuse_a_non_int_l2_or_l3_by_name(field: str, value: object) -> None:
    """L2/L3 page counts must be non-negative ints (a bool is not one); the error names the
    field and repeats the value."""
    with pytest.raises(ConfigError, match=rf"^{field} must be a non-negative int, got {value!r}$"):
        TierSizes(8, **{field: value})  # type: ignore[arg-type]


def test_histogram_counts_every_observation() -> None:
    """Observations in the same bucket add up; the +Inf bucket catches what is past the last
    bound, and the sum is the sum of the values."""
    h = Histogram(bounds=(1.0, 2.0))
    for value in (0.5, 0.75, 1.0, 1.5, 3.0, 4.0, 5.0):
        h.observe(value)
    assert h.counts == [3, 1, 3]
    assert h.count == 7
    assert h.cumulative() == [("1.0", 3.0), ("2.0", 4.0), ("+Inf", 7.0)]
    assert h.sum == 15.75
