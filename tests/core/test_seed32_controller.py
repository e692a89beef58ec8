"""Controller contracts the seed-32 mutation draw found unchecked: the default hit count of
selective write-through, a restore refused by name when a store's reachability check
releases the request, extents adding up, a finished restore's fields, its latency and
transitions, and the request snapshot the request invariants read. The movers hold every
copy until told (hicache.testing.tag_movers)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest

from hicache.core.cache import CacheCore
from hicache.core.controller import Controller, Outcome, PendingRestore, Request
from hicache.core.cost import CostModel, CostPriors
from hicache.core.geometry import TierSizes
from hicache.errors import IntegrityError, MisuseError
from hicache.facade import HiCacheConfig
from hicache.spec.model import Direction, Tier
from hicache.spec.request import ReqEvent, ReqState
from hicache.spec.snapshot import RequestView
from hicache.testing.tag_movers import TagDevice, TagFabric, TagStorage
from tests.core.test_seed26_controller import PS, _cached, _make
from tests.core.test_seed28_controller import _finish_queued, _make_without_storage, _prefill


def _l2_restore(c: Controller, fabric: TagFabric, tokens: list[int]) -> tuple[Request, PendingRestore]:
    """``tokens`` cached in L2 (and L3) only, admitted, its L2 restore's H2D queued."""
    _cached(c, tokens, Tier.L1)
    req = c.admit(tokens)
    pending = c.start_restore(req)
    assert pending is not None and pending.plan.tier is Tier.L2
    assert [t.direction for t in fabric.queue] == [Direction.H2D]
    return req, pending


def _view(c: Controller, req: Request) -> RequestView:
    """``req`` as the controller's snapshot shows it to the request invariants."""
    views = c.snapshot().requests
    assert views is not None
    return views[req.id]


def test_selective_write_through_backs_up_on_the_configs_default_hit_count() -> None:
    """A controller built without ``selective_hits`` backs a prefix up on the L1 match
    count HiCacheConfig defaults to (2): not on the first match, on the second."""
    default = next(f.default for f in dataclasses.fields(HiCacheConfig) if f.name == "selective_hits")
    assert default == 2
    sizes = TierSizes(8, 8, 0)
    fabric = TagFabric(sizes.capacities)
    cost = CostModel(1, CostPriors(), "always")
    core = CacheCore(PS, sizes, tracing=True)
    c = Controller(core, TagDevice(fabric), None, cost, write_policy="write_through_selective")
    _prefill(c, [1, 2, 3, 4])
    assert fabric.queue == []
    for _ in range(default - 1):
        c.release(c.admit([1, 2, 3, 4]))
        assert fabric.queue == []
    c.release(c.admit([1, 2, 3, 4]))
    assert [t.direction for t in fabric.queue] == [Direction.D2H]
    c.close()


class _ReleasingStore(TagStorage):
    """A store whose reachability check releases a request it was armed with."""

    def __init__(self, fabric: TagFabric) -> None:
        super().__init__(fabric)
        self.controller: Controller | None = None
        self.armed: Request | None = None

    @property
    def available(self) -> bool:
        if self.controller is not None and self.armed is not None:
            req, self.armed = self.armed, None
            self.controller.release(req)
        return True


def test_a_restore_whose_store_releases_the_request_while_planning_is_refused_by_name() -> None:
    """A store that releases the request while start_restore plans it (nothing to
    restore): start_restore raises MisuseError naming itself, the request, its state and
    the step, and counts no fallback; integrity holds."""
    store = _ReleasingStore(TagFabric(TierSizes(8, 8, 16).capacities))
    c, _ = _make(storage=store)
    req = c.admit([1, 2, 3, 4])
    store.controller, store.armed = c, req
    refused = rf"^start_restore: request #{req.id} is released; 'skip' is not allowed there$"
    with pytest.raises(MisuseError, match=refused):
        c.start_restore(req)
    assert req.released and c.metrics.fallbacks == 0
    c.check_integrity()
    c.close()


def test_extents_add_up_over_copies() -> None:
    """Two D2H copies of one extent each count two D2H extents."""
    c, _ = _make_without_storage()
    _cached(c, [1, 2])
    _cached(c, [3, 4])
    d2h = c.metrics.directions[Direction.D2H.name]
    assert (d2h.count, d2h.extents) == (2, 2)
    c.close()


def test_a_copy_failed_without_a_reason_fails_its_restore_as_transfer_failed() -> None:
    """An H2D the mover fails without saying why: the restore fails with the error
    "transfer failed", counts one fallback, and the request recomputes from nothing."""
    c, fabric = _make()
    req, pending = _l2_restore(c, fabric, [1, 2, 3, 4])
    ticket = fabric.queue[0]
    fabric.finish(ticket, ok=False)
    ticket.error = None
    c.poll()
    assert (pending.outcome, pending.error) == (Outcome.FAILED, "transfer failed")
    assert c.metrics.fallbacks == 1 and req.state is ReqState.READY and req.cached_len == 0
    c.release(req)
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("ok", [True, False])
def test_a_finished_restore_holds_no_transfer_and_no_pin(ok: bool) -> None:
    """Once a restore published or failed, it has no transfer in flight and no source pin."""
    c, fabric = _make()
    req, pending = _l2_restore(c, fabric, [1, 2, 3, 4])
    assert None not in (pending.transfer, pending.source)
    fabric.finish(fabric.queue[0], ok=ok)
    c.poll()
    assert pending.outcome is (Outcome.DONE if ok else Outcome.FAILED)
    assert (pending.transfer, pending.source) == (None, None)
    c.release(req)
    c.check_integrity()
    c.close()


def test_a_restores_latency_lies_within_the_calls_that_made_it() -> None:
    """The latency recorded for a restore is no longer than the wall time around the calls
    that started and finished it (and not negative)."""
    c, fabric = _make()
    _cached(c, [1, 2, 3, 4], Tier.L1)
    t0 = time.perf_counter()
    req = c.admit([1, 2, 3, 4])
    assert c.start_restore(req) is not None
    _finish_queued(c, fabric)
    t1 = time.perf_counter()
    assert c.metrics.restores == 1 and req.cached_len == 4
    assert 0.0 <= c.metrics.restore_s <= t1 - t0
    c.release(req)
    c.close()


def test_a_published_restore_takes_the_publish_transition() -> None:
    """A successful L2 restore leaves the request ready with its prefix, having taken
    admitted -> loading_l2 -> ready by start_l2 and publish (never fail)."""
    c, fabric = _make()
    _cached(c, [1, 2, 3, 4], Tier.L1)
    before = Counter(c.request_coverage)  # the prefill's own transitions
    req = c.admit([1, 2, 3, 4])
    assert c.start_restore(req) is not None
    _finish_queued(c, fabric)
    assert req.state is ReqState.READY and req.cached_len == 4
    assert c.request_coverage - before == {
        (ReqState.ADMITTED, ReqEvent.START_L2): 1,
        (ReqState.LOADING_L2, ReqEvent.PUBLISH): 1,
    }
    c.release(req)
    c.close()


def test_a_broken_request_invariant_names_the_request_by_its_number() -> None:
    """The snapshot shows each live request under its number, and a request whose
    cached_len is off its pages is reported at ``request #<its number>``."""
    c, _ = _make()
    c.release(c.admit([9, 9]))  # the request below is #2
    req = c.admit([1, 2, 3, 4])
    assert _view(c, req).id == req.id == 2
    req.cached_len = 1
    with pytest.raises(IntegrityError) as broken:
        c.check_integrity()
    assert (broken.value.invariant, broken.value.where) == ("request-cached", "request #2")
    req.cached_len = 0
    c.release(req)
    c.close()


def test_the_request_invariants_see_a_layered_restores_pages() -> None:
    """While a layered H2D is in flight the snapshot carries the restore's pages, so pages
    that are not exactly its prefix's are reported."""
    c, fabric = _make()
    _cached(c, [1, 2, 3, 4], Tier.L1)
    req = c.admit([1, 2, 3, 4])
    pending = c.start_restore(req, layer_events=[])
    assert pending is not None and pending.pages is not None and len(pending.pages) == 2
    assert _view(c, req).restore_pages == tuple(pending.pages)
    assert c.violations() == []
    good = pending.layer_pages
    assert good is not None
    pending.layer_pages = good[::-1]
    assert [v.code for v in c.violations()] == ["request-restore-pages.layered-pages"]
    pending.layer_pages = good
    _finish_queued(c, fabric)
    assert req.cached_len == 4
    c.release(req)
    c.check_integrity()
    c.close()


def test_a_layered_restores_pages_are_the_callers_copy() -> None:
    """An engine builds its page table from ``pages`` (appending its tail, reordering): what
    is published, and where, does not change."""
    c, fabric = _make()
    _cached(c, [1, 2, 3, 4], Tier.L1)
    req = c.admit([1, 2, 3, 4])
    pending = c.start_restore(req, layer_events=[])
    assert pending is not None and pending.pages is not None
    want = pending.pages
    table = pending.pages
    table += c.allocate(req, 1) or []
    table.reverse()
    assert pending.pages == want
    _finish_queued(c, fabric)
    assert pending.done and c.prefix_pages(req) == want
    c.check_integrity()
    c.release(req)
    c.check_integrity()
    c.close()


def test_each_failed_restore_counts_one_fallback() -> None:
    """Two L2 restores whose H2D copies fail count two fallbacks."""
    c, fabric = _make()
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    for tokens in prompts:
        _cached(c, tokens, Tier.L1)
    reqs = [c.admit(tokens) for tokens in prompts]
    for req in reqs:
        assert c.start_restore(req) is not None
    assert len(fabric.queue) == 2
    for ticket in list(fabric.queue):
        fabric.finish(ticket, ok=False)
    c.poll()
    assert c.metrics.fallbacks == 2
    for req in reqs:
        c.release(req)
    c.close()


def test_status_counts_the_live_requests_in_each_state() -> None:
    """With two requests admitted and one prefilling, status counts 2 admitted, 1
    prefilling and none in any other state."""
    c, _ = _make()
    waiting = [c.admit([1, 2]), c.admit([3, 4])]
    busy = c.admit([5, 6])
    c.start_restore(busy)
    assert c.allocate(busy, 1) is not None
    states = c.status().request_states
    assert {s: n for s, n in states.items() if n} == {ReqState.ADMITTED.value: 2, busy.state.value: 1}
    assert busy.state is ReqState.PREFILLING
    for req in [*waiting, busy]:
        c.release(req)
    c.close()
