"""CostModel.decide: the exact plans at its boundaries (nothing to restore, exploration at 2x)."""

from __future__ import annotations

import pytest

from hicache.core.cost import CostModel, CostPriors, Plan, Policy
from hicache.spec.model import Tier


@pytest.mark.parametrize(
    ("policy", "hits"),
    [(Policy.NEVER, (4, 8, 8)), (Policy.ALWAYS, (4, 4, 2)), (Policy.COST, (4, 4, 2))],
)
def test_a_plan_that_restores_nothing_keeps_the_l1_hit_at_zero_cost(policy: Policy, hits: tuple[int, int, int]) -> None:
    """When nothing is restored the plan is the L1 hit with benefit and costs all exactly 0."""
    m = CostModel(1024, CostPriors(explore=0), policy)
    assert m.decide(*hits) == Plan(Tier.L1, 4, 0.0, 0.0, 0.0)


def test_exploration_includes_a_restore_costing_exactly_twice_its_saving() -> None:
    """A restore predicted at exactly 2x the recompute it saves is still explored, for its
    whole prefix (powers of two keep the arithmetic exact)."""
    priors = CostPriors(recompute_s_per_token=2.0**-11, host_gib_s=1.0, explore=2)
    m = CostModel(2**20, priors)  # an L2 restore: 2**-10 s per token, twice the 2**-11 saved
    plan = m.decide(0, 4, 0)
    assert plan == Plan(Tier.L2, 4, 2.0**-9 - 2.0**-8, 2.0**-8, 2.0**-9, explore=True)
    assert m.explored[Tier.L2] == 1
