"""Counters that status() and Prometheus report add up over many events, not just the last."""

from __future__ import annotations

from hicache.core import CacheCore, DevicePage, TierSizes
from hicache.spec.model import Direction, Tier
from tests.core.test_controller import make as make_cache
from tests.core.test_tree import make, prefill


def test_insert_walks_twice_and_adopt_once() -> None:
    """insert validates its pages in a walk of its own before inserting; adopt walks once."""
    core = CacheCore(2, TierSizes(8, 8, 8))
    pages = core.allocate_l1(2)
    assert pages is not None
    walks = core.tree.walks
    core.insert((1, 2, 3, 4), pages)
    assert core.tree.walks - walks == 2
    more = core.allocate_l1(1)
    assert more is not None
    walks = core.tree.walks
    core.adopt((5, 6), [DevicePage(p) for p in more], 0)
    assert core.tree.walks - walks == 1


def test_evicted_pages_add_up_and_an_emptied_run_is_dead() -> None:
    """status() counts every page evicted from a tier; a run left with no copy is removed
    (``alive`` is False and the tree no longer lists it)."""
    core = make()
    a = prefill(core, (1, 2, 3, 4))
    b = prefill(core, (5, 6))
    assert core.evict(Tier.L1, 100) == 3
    assert core.status().tiers[Tier.L1].evicted == 3
    for n in (a, b):
        assert n.alive is False
        assert n.id not in core.tree.nodes


def test_status_counts_every_transfer_in_flight_per_direction() -> None:
    """Two D2H backups in flight show as 2 under D2H, none elsewhere."""
    core = make()
    xs = [core.start(Direction.D2H, prefill(core, p)) for p in ((1, 2), (3, 4))]
    assert all(x is not None for x in xs)
    assert core.status().transfers_in_flight == {"D2H": 2, "H2S": 0, "S2H": 0, "H2D": 0}


def test_prometheus_reports_the_live_requests() -> None:
    """The requests gauge is the number admitted and not released."""
    c = make_cache()
    reqs = [c.admit(list(range(k, k + 4))) for k in (0, 10)]
    assert "\nhicache_requests 2.0\n" in c.prometheus()
    c.release(reqs[0])
    assert "\nhicache_requests 1.0\n" in c.prometheus()
    c.release(reqs[1])
    c.close()
