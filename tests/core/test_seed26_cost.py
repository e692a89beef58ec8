"""Cost-model contracts the seed-26 mutation draw found unchecked: empty and negative sizes
cost nothing, a storage read that reads nothing, the fit's span rule and its fit through the
origin, the recompute a restore saves, and which direction's samples gate exploring L3.

Every value is a power of two (or a short sum of them), so the arithmetic is exact in binary
floats and each expectation is spelled out from the formulas in DESIGN.md §7 and cost.py."""

from __future__ import annotations

import pytest

from hicache.core.cost import AffineCost, CostModel, CostPriors, Plan, Policy
from hicache.spec.model import Direction, Tier

# 2**20 bytes per token at 1 GiB/s: 2**-10 s per token per direction; recompute 2**-9 s/token.
B = 2**20
T = 2.0**-10
S_R = 2.0**-9


def _model(policy: Policy = Policy.COST) -> CostModel:
    priors = CostPriors(recompute_s_per_token=S_R, host_gib_s=1.0, storage_read_gib_s=1.0)
    return CostModel(B, priors, policy)


@pytest.mark.parametrize("size", [0, -4])
def test_no_units_cost_nothing_even_with_a_fixed_cost(size: int) -> None:
    """predict and marginal of zero or negative sizes are 0: a transfer that moves nothing
    pays no fixed cost, and a negative size never earns time back."""
    model = AffineCost(prior_slope=0.25, fixed=0.5)
    assert model.predict(size) == 0.0
    assert model.marginal(size) == 0.0
    assert model.predict(4) == 0.5 + 4 * 0.25  # the same model does charge a real transfer


def test_an_l3_restore_whose_target_is_all_in_l2_costs_only_the_h2d() -> None:
    """C_L3 reads from storage only the tokens not already in L2: when the target lies
    within the L2 hit, restoring "from L3" costs exactly the L2 restore, even though storage
    reads have learned a fixed cost."""
    model = _model()
    model.observe_transfer(Direction.S2H, B, T + 2.0**-5)  # residual 2**-5 becomes the fixed cost
    assert model.transfer[Direction.S2H].fixed == 2.0**-5
    assert model.restore_cost(Tier.L3, 2, 6, 6, 6) == 4 * T
    assert model.restore_cost(Tier.L3, 2, 6, 6, 6) == model.restore_cost(Tier.L2, 2, 6, 6, 6)
    # Two tokens past the L2 hit: the storage read's fixed cost plus its two tokens, then H2D.
    assert model.restore_cost(Tier.L3, 2, 6, 8, 8) == (2.0**-5 + 2 * T) + 6 * T


def test_sizes_two_apart_spanning_a_factor_of_two_are_fitted() -> None:
    """Sizes 1 and 3 differ by more than 1 and the smallest is at most half the largest, so
    both terms are fitted by least squares: slope (2 - 1) / (3 - 1), fixed 1 - slope."""
    model = AffineCost(prior_slope=0.25)
    model.observe(1, 1.0)
    model.observe(3, 2.0)
    slope = (2.0 - 1.0) / (3 - 1)
    assert (model.fixed, model.slope) == (1.0 - slope * 1, slope) == (0.5, 0.5)


def test_a_negative_intercept_refits_through_the_origin() -> None:
    """A least-squares line with a negative intercept is replaced by the fit through the
    origin: slope = sum(x * t) / sum(x * x), fixed 0."""
    model = AffineCost(prior_slope=0.25)
    samples = [(1, 0.125), (3, 1.625)]  # least squares: slope 0.75, intercept -0.625
    for size, seconds in samples:
        model.observe(size, seconds)
    through_origin = (1 * 0.125 + 3 * 1.625) / (1 * 1 + 3 * 3)
    assert through_origin == 0.5
    assert (model.fixed, model.slope) == (0.0, through_origin)


@pytest.mark.parametrize("policy", [Policy.COST, Policy.ALWAYS])
def test_a_restore_saves_the_recompute_of_the_tokens_past_the_l1_hit(policy: Policy) -> None:
    """With 2 tokens already in L1 and 6 in L2, restoring from L2 saves recomputing the 4
    tokens in between: (6 - 2) * s_r, against the H2D of those 4 tokens."""
    plan = _model(policy).decide(2, 6, 0)
    recompute = (6 - 2) * S_R
    restore = (6 - 2) * T
    assert plan == Plan(Tier.L2, 6, recompute - restore, restore, recompute)


def test_exploring_l3_counts_storage_read_samples_not_host_ones() -> None:
    """Whether L3 is still worth a trial depends on the S2H samples: host (H2D) samples
    neither stop nor allow it. Here no candidate wins on the priors (benefit exactly 0)."""
    recompute = restore = 8 * S_R  # restore: 8 tokens S2H + 8 tokens H2D, 2**-10 s each
    host_learned = _model()
    for _ in range(2):
        host_learned.observe_transfer(Direction.H2D, B, T)
    assert host_learned.decide(0, 0, 8) == Plan(Tier.L3, 8, 0.0, restore, recompute, explore=True)
    storage_learned = _model()
    for _ in range(2):
        storage_learned.observe_transfer(Direction.S2H, B, T)
    assert storage_learned.decide(0, 0, 8) == Plan(Tier.L1, 0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("policy", [Policy.ALWAYS, Policy.COST])
def test_a_plans_benefit_weighs_the_restore_by_the_margin_under_every_policy(policy: Policy) -> None:
    """``benefit_s`` is recompute saved minus margin times restore (Plan's docstring), also
    under ``always``, where it informs and does not decide."""
    priors = CostPriors(recompute_s_per_token=S_R, host_gib_s=1.0, storage_read_gib_s=1.0, margin=1.5)
    plan = CostModel(B, priors, policy).decide(0, 64, 0)  # 64 tokens in L2, none in L1
    restore, recompute = 64 * T, 64 * S_R  # an H2D of 64 tokens; their recompute (no fixed costs)
    assert plan.tier is Tier.L2 and plan.tokens == 64
    assert plan.predicted_restore_s == restore and plan.predicted_recompute_s == recompute
    assert plan.benefit_s == recompute - 1.5 * restore
