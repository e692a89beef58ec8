"""Controller counters that must add up over several events: each test drives one counter's
update at least twice and checks the exact total, so a counter that is overwritten, counts
down or counts double fails. The movers hold every copy until told
(hicache.testing.tag_movers)."""

from __future__ import annotations

import pytest

from hicache.core.cache import CacheCore
from hicache.core.controller import Controller
from hicache.core.cost import CostModel, CostPriors
from hicache.core.geometry import TierSizes
from hicache.spec.model import Direction, Tier
from hicache.testing.tag_movers import TagDevice, TagFabric, TagStorage, TagTicket
from tests.core.test_seed26_controller import PS, _cached, _make
from tests.core.test_seed27_core import _make as _make_shared
from tests.core.test_seed28_controller import _finish_queued, _make_without_storage, _prefill


def _refuse(*args: object, **kwargs: object) -> TagTicket:
    raise RuntimeError("no copy engine")


def test_each_discovery_adds_the_l3_slots_it_recorded() -> None:
    """A shared store holding the first 2 pages of every prompt: two prompts it was asked
    about record 2 L3 pages each, 4 in all."""
    c, _ = _make_shared(held=2)
    for tokens in ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]):
        req = c.admit(tokens)
        assert req.hit == (0, 0, 4)
        c.release(req)
    assert c.metrics.l3_discovered_pages == 4
    c.close()


def test_each_l3_read_past_its_deadline_counts_one_deadline_failure() -> None:
    """Two L3 restores failed by their deadline count two deadline failures."""
    c, fabric = _make()
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    for tokens in prompts:
        _cached(c, tokens, Tier.L1, Tier.L2)
    reqs = [c.admit(tokens) for tokens in prompts]
    for req in reqs:
        pending = c.start_restore(req)
        assert pending is not None and pending.plan.tier is Tier.L3
    assert len(fabric.queue) == 2
    for ticket in list(fabric.queue):
        fabric.expire(ticket)
    c.poll()
    assert c.metrics.l3_deadline_failures == 2
    for ticket in list(fabric.queue):
        fabric.settle(ticket)
    c.poll()
    for req in reqs:
        c.release(req)
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("tier", [Tier.L2, Tier.L3], ids=["L2", "L3"])
def test_restored_tokens_add_up_per_tier(tier: Tier) -> None:
    """Two restores from one tier, of 6 and 4 tokens, add 10 tokens to that tier's hits."""
    c, _ = _make()
    drop = (Tier.L1,) if tier is Tier.L2 else (Tier.L1, Tier.L2)
    prompts = [list(range(6)), list(range(10, 14))]
    for tokens in prompts:
        _cached(c, tokens, *drop)
    for tokens in prompts:
        req = c.admit(tokens)
        assert c.restore(req)
        c.release(req)
    assert c.metrics.hit_tokens[tier.name] == 10
    c.close()


def test_each_deferred_backup_the_mover_cannot_issue_is_skipped_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two extensions of a prefix whose D2H is in flight wait for it; when it lands and the
    device mover refuses their copies, each counts one skipped backup and one failed D2H."""
    c, fabric = _make()
    _prefill(c, [1, 2])
    _prefill(c, [1, 2, 3, 4])
    _prefill(c, [1, 2, 5, 6])
    assert [t.direction for t in fabric.queue] == [Direction.D2H]
    monkeypatch.setattr(c.device, "d2h", _refuse)
    _finish_queued(c, fabric)
    assert c.metrics.backups_skipped == 2
    assert c.metrics.directions[Direction.D2H.name].failed == 2
    c.check_integrity()
    c.close()


def test_l1_hits_at_admission_add_up() -> None:
    """Two admissions hitting 4 and 6 tokens in L1 add 10 tokens to the L1 hits."""
    c, _ = _make()
    _cached(c, list(range(6)))
    for n in (4, 6):
        req = c.admit(list(range(n)))
        assert req.cached_len == n
        c.release(req)
    assert c.metrics.hit_tokens["L1"] == 10
    c.close()


def test_each_plan_that_keeps_l1_over_a_longer_hit_counts_one_policy_skip() -> None:
    """Under the "never" policy, two plans that keep the L1 hit although L2 holds more count
    two policy skips."""
    sizes = TierSizes(8, 8, 0)
    fabric = TagFabric(sizes.capacities)
    cost = CostModel(1, CostPriors(), "never")
    c = Controller(CacheCore(PS, sizes), TagDevice(fabric), None, cost)
    _prefill(c, [1, 2, 3, 4])
    c.drain()
    c.core.evict(Tier.L1, 10**6)
    for _ in range(2):
        req = c.admit([1, 2, 3, 4])
        assert req.hit == (0, 4, 0) and c.plan(req).tier is Tier.L1
        c.release(req)
    assert c.metrics.policy_skips == 2
    c.close()


def test_each_write_back_victim_the_mover_cannot_back_up_is_skipped_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under write_back, making room by evicting two L1 runs whose D2H the device mover
    refuses counts two skipped backups; the room is made anyway."""
    c, _ = _make_without_storage("write_back")
    _prefill(c, list(range(16)))
    _prefill(c, list(range(100, 116)))
    assert c.core.status().tiers[Tier.L1].free == 0
    monkeypatch.setattr(c.device, "d2h", _refuse)
    req = c.admit(list(range(200, 232)))
    assert c.allocate(req, 16) is not None
    assert c.metrics.backups_skipped == 2
    c.release(req)
    c.check_integrity()
    c.close()


def test_each_write_through_the_mover_cannot_issue_is_skipped_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts inserted while the device mover refuses every D2H count two skipped
    backups."""
    c, _ = _make_without_storage()
    monkeypatch.setattr(c.device, "d2h", _refuse)
    _prefill(c, [1, 2, 3, 4])
    _prefill(c, [5, 6, 7, 8])
    assert c.metrics.backups_skipped == 2
    c.check_integrity()
    c.close()


def test_each_write_through_too_big_for_l2_is_skipped_once() -> None:
    """With 2 L2 pages, two 4-page prompts cannot be written through: two skipped backups,
    no copy issued."""
    sizes = TierSizes(16, 2, 0)
    fabric = TagFabric(sizes.capacities)
    c = Controller(CacheCore(PS, sizes), TagDevice(fabric), None, CostModel(1, CostPriors(), "always"))
    _prefill(c, list(range(8)))
    _prefill(c, list(range(100, 108)))
    assert c.metrics.backups_skipped == 2 and fabric.queue == []
    c.close()


def test_each_write_through_to_a_store_without_l3_pages_is_skipped_once() -> None:
    """A store given with no L3 pages: the two prompts' backups reach L2 and count two
    skipped backups to storage; nothing is written to it."""
    sizes = TierSizes(8, 8, 0)
    fabric = TagFabric(sizes.capacities)
    cost = CostModel(1, CostPriors(), "always")
    c = Controller(CacheCore(PS, sizes), TagDevice(fabric), TagStorage(fabric), cost)
    _prefill(c, [1, 2, 3, 4])
    _prefill(c, [5, 6, 7, 8])
    _finish_queued(c, fabric)
    assert c.metrics.backups_skipped == 2 and fabric.queue == []
    assert c.core.match_valid((5, 6, 7, 8)).lengths == (4, 4, 0)
    c.close()


def test_copied_bytes_add_up_per_direction() -> None:
    """Two D2H backups of 2 and 3 pages (a tag mover counts one byte per page) count two
    copies and 5 bytes."""
    c, fabric = _make()
    _prefill(c, [1, 2, 3, 4])
    _prefill(c, [5, 6, 7, 8, 9, 10])
    _finish_queued(c, fabric)
    d2h = c.metrics.directions[Direction.D2H.name]
    assert (d2h.count, d2h.bytes) == (2, 5)
    c.close()
