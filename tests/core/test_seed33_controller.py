"""Controller contracts the seed-33 mutation draw found unchecked: a run a store lost while
someone pinned it, whose L3 copy then went another way, keeps the fresh copy it is backed
up to later; and only a restore started with layer events carries the page list the
device fills layer by layer. The movers hold every copy until told
(hicache.testing.tag_movers)."""

from __future__ import annotations

from hicache.core.controller import Controller, Outcome
from hicache.spec.model import Direction, Tier
from hicache.spec.request import ReqState
from hicache.testing.tag_movers import TagFabric, TagTicket
from tests.core.test_seed26_controller import _cached, _make
from tests.core.test_seed28_controller import _finish_queued, _prefill


def _queued(fabric: TagFabric, direction: Direction) -> TagTicket:
    """The one copy in ``direction`` waiting in the fabric."""
    tickets = [t for t in fabric.queue if t.direction is direction]
    assert len(tickets) == 1, [t.direction for t in fabric.queue]
    return tickets[0]


def test_a_fresh_l3_copy_of_a_run_lost_while_pinned_is_not_forgotten_later() -> None:
    """A read finds a run gone from the store while someone pins its L3 copy: the copy is
    kept (not counted lost). The copy then goes another way (evicted) before it could be
    forgotten, and write-through backs the recomputed run up to L3 again: that fresh copy
    stays, nothing is counted lost, and the run restores from L3."""
    c, fabric = _make()
    tokens = [1, 2, 3, 4]
    _cached(c, tokens, Tier.L1, Tier.L2)
    req = c.admit(tokens)
    assert req.hit == (0, 0, 4)
    pending = c.start_restore(req)
    assert pending is not None and pending.plan.tier is Tier.L3
    pin = c.core.lock(req.match.l3)  # another holder of the run's L3 copy
    fabric.finish(_queued(fabric, Direction.S2H), ok=False, lost=True)
    c.poll()
    assert pending.outcome is Outcome.FAILED and req.state is ReqState.READY
    assert c.metrics.l3_lost_runs == 0 and c.core.match(tokens).lengths == (0, 0, 4)  # pinned: kept
    pages = c.allocate(req, 2)  # the request recomputes; write-through backs it up
    assert pages is not None and c.insert(req, pages) == 4
    c.release(req)
    c.core.release(pin)
    c.core.evict(Tier.L3, 10**6)  # the lost copy goes another way before it is forgotten
    assert c.core.match(tokens).lengths == (4, 0, 0)
    _finish_queued(c, fabric)  # D2H: the run is in L2; its H2S starts
    _finish_queued(c, fabric)  # H2S: a fresh L3 copy
    assert fabric.queue == [] and c.core.match(tokens).lengths == (4, 4, 4)
    c.core.evict(Tier.L1, 10**6)
    c.core.evict(Tier.L2, 10**6)
    _prefill(c, [5, 6])  # other transfers end: the controller retries what it put off
    c.drain()
    assert c.metrics.l3_lost_runs == 0
    again = c.admit(tokens)
    assert again.hit == (0, 0, 4)
    assert c.restore(again) and again.cached_len == 4
    c.release(again)
    c.check_integrity()
    c.close()


def _only_pages_when_asked(c: Controller, fabric: TagFabric) -> None:
    """Drive an L2 restore without layer events and an L3 restore with them to their H2D:
    neither carries a layered page list."""
    _cached(c, [5, 6, 7, 8], Tier.L1, Tier.L2)
    _cached(c, [1, 2, 3, 4], Tier.L1)
    from_l2 = c.admit([1, 2, 3, 4])
    plain = c.start_restore(from_l2)
    assert plain is not None and plain.plan.tier is Tier.L2
    assert (plain.pages, plain.layered) == (None, False)
    from_l3 = c.admit([5, 6, 7, 8])
    promoted = c.start_restore(from_l3, layer_events=[])  # an L3 restore ignores them
    assert promoted is not None and promoted.plan.tier is Tier.L3
    assert (promoted.pages, promoted.layered) == (None, False)
    fabric.finish(_queued(fabric, Direction.S2H), ok=True)
    c.poll()
    assert from_l3.state is ReqState.LOADING_L2 and promoted.transfer is not None
    assert promoted.transfer.direction is Direction.H2D
    assert (promoted.pages, promoted.layered) == (None, False)
    _finish_queued(c, fabric)
    assert plain.done and promoted.done and from_l2.cached_len == from_l3.cached_len == 4
    for req in (from_l2, from_l3):
        c.release(req)


def test_only_a_restore_started_with_layer_events_carries_a_layered_page_list() -> None:
    """An L2 restore started without layer events, and an L3 restore (which ignores them)
    once its H2D runs, have no page list (``layered`` is False); both still publish."""
    c, fabric = _make()
    _only_pages_when_asked(c, fabric)
    c.check_integrity()
    c.close()
