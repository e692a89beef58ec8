"""More contracts of the core that users rely on: page checks, tracing of inserts, finished
transfers, discover without room, cost learning and exploration bounds, key seeds,
histograms, removed runs and copy versions."""

from __future__ import annotations

import pytest
import torch

from hicache.core.allocator import PageAllocator
from hicache.core.cost import AffineCost, CostModel, CostPriors, Plan
from hicache.core.geometry import KVGeometry
from hicache.core.keys import format_seed
from hicache.core.metrics import Histogram
from hicache.errors import ConfigError, HandleError, MisuseError, PageOwnershipError
from hicache.spec.model import Direction, Event, RunState, Tier
from tests.core.test_tree import make, prefill, through


def test_check_allocated_refuses_a_bool_even_where_its_int_value_is_allocated() -> None:
    """``True`` is not a page id, even though page 1 is allocated: refused, named."""
    alloc: PageAllocator[int] = PageAllocator(4)
    assert alloc.allocate(2) == [0, 1]
    alloc.check_allocated([1])
    with pytest.raises(PageOwnershipError, match="must be ints, got True"):
        alloc.check_allocated([True])


def test_an_insert_is_traced_on_the_new_run() -> None:
    """The INSERT that creates a run is traced under that run's id."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    entry = core.tree.trace[-1]
    assert (entry.event, entry.before, entry.after) == (Event.INSERT, RunState.L1_PRIVATE, RunState.L1)
    assert entry.node == node.id


def test_a_completed_or_failed_transfer_is_marked_done() -> None:
    """Once completed (or failed) a transfer says it is done, and finishing it again is refused."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    x = core.start(Direction.D2H, node)
    assert x is not None
    was_done = x.done
    core.complete(x)
    assert not was_done
    assert x.done
    with pytest.raises(HandleError):
        core.complete(x)
    y = core.start(Direction.H2S, node)
    assert y is not None
    core.fail(y)
    assert y.done


def test_discover_without_room_returns_the_l3_match_the_path_already_has() -> None:
    """With L3 full of the path's own (pinned) prefix, discover of a longer prompt records
    nothing and returns the L3 match of that prefix."""
    core = make(l3=2)
    node = prefill(core, (1, 2, 3, 4))
    core.discover((1, 2, 3, 4), 2)
    assert core.l3.num_free == 0
    got = core.discover((1, 2, 3, 4, 5, 6, 7, 8), 4)
    assert (got.tier, got.length, got.node) == (Tier.L3, 4, node)
    assert core.l3.num_free == 0 and len(core.tree.nodes) == 2
    core.check_integrity()


def test_a_negative_cost_prior_is_refused_naming_both_priors() -> None:
    """The ConfigError for a negative prior names the values given."""
    with pytest.raises(ConfigError, match=r"slope=-1\.0 fixed=0\.5"):
        AffineCost(-1.0, fixed=0.5)


def test_a_sample_of_size_zero_teaches_nothing() -> None:
    """``observe(0, s)`` is ignored: no sample kept or held back, the prediction unchanged."""
    cost = AffineCost(1.0)
    cost.observe(0, 0.0)
    cost.observe(0, 5.0)
    assert len(cost.samples) == 0 and cost.held is None
    assert cost.predict(4) == 4.0


def test_exploration_skips_a_restore_costing_more_than_twice_its_saving() -> None:
    """A restore predicted at 2.5x the recompute it saves is not explored: the L1 plan."""
    priors = CostPriors(recompute_s_per_token=2.0**-11, host_gib_s=1.0, explore=2)
    m = CostModel(5 * 2**18, priors)  # an L2 restore: 5 * 2**-12 s per token, 2.5x 2**-11
    assert m.decide(0, 4, 0) == Plan(Tier.L1, 0, 0.0, 0.0, 0.0)
    assert m.explored[Tier.L2] == 0


def test_an_empty_model_id_is_refused_naming_it() -> None:
    """format_seed refuses an empty model id with a MisuseError that shows the value."""
    g = KVGeometry(4, 2, 64, 4, torch.bfloat16)
    with pytest.raises(MisuseError, match=r"model_id must be a non-empty str of text, got ''"):
        format_seed("", g)


def test_a_histogram_whose_counts_miss_a_bucket_refuses_to_report() -> None:
    """Counts one short of the buckets (bounds plus +Inf) are not silently truncated: the
    constructor refuses them, and a list cut short afterwards fails the exposition."""
    h = Histogram(bounds=(1.0, 2.0), counts=[1, 2, 0])
    h.counts.pop()
    with pytest.raises(ValueError, match="shorter"):
        h.cumulative()


def test_a_removed_run_is_unlinked_from_its_parent() -> None:
    """Eviction that empties a leaf removes it: dead, out of the tree, with no parent."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    core.evict(Tier.L1, 100)
    assert not node.alive and node.id not in core.tree.nodes
    assert node.parent is None
    assert core.tree.path(node) == []


def test_dropping_a_copy_bumps_its_version() -> None:
    """Each drop of a tier's copy increases that tier's version (stale handles are told
    apart by it); the other tiers' versions stay."""
    core = make()
    node = prefill(core, (1, 2, 3, 4))
    through(core, node, Direction.D2H)
    v1, v2 = node.version[Tier.L1], node.version[Tier.L2]
    core.evict(Tier.L1, 100)
    assert node.version[Tier.L1] > v1 and node.version[Tier.L2] == v2
    core.check_integrity()
