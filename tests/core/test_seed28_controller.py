"""Controller contracts the seed-28 mutation draw found unchecked: refusals that name the
call and the bad value, a restore whose run is already being loaded, the unavailable-store
and timing counters, the pending-backup gauge, withdrawing a queued backup at close and a
deferred backup that ends once its run holds the copy. The movers hold every copy until
told (hicache.testing.tag_movers)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hicache.core.cache import CacheCore
from hicache.core.controller import Controller
from hicache.core.cost import CostModel, CostPriors
from hicache.core.geometry import TierSizes
from hicache.errors import MisuseError
from hicache.spec.model import Direction, Tier
from hicache.spec.request import ReqState
from hicache.testing.tag_movers import TagDevice, TagFabric, TagStorage, TagTicket
from tests.core.test_seed26_controller import PS, _cached, _make


def _finish_queued(c: Controller, fabric: TagFabric) -> None:
    """Complete every copy queued now (not those they start), then let the controller see it."""
    for ticket in list(fabric.queue):
        fabric.finish(ticket, ok=True)
    c.poll()


def _make_without_storage(write_policy: str = "write_through") -> tuple[Controller, TagFabric]:
    """A controller over tag movers with L1 and L2 only (16 pages each)."""
    sizes = TierSizes(16, 16, 0)
    fabric = TagFabric(sizes.capacities)
    core = CacheCore(PS, sizes, tracing=True)
    cost = CostModel(1, CostPriors(), "always")
    return Controller(core, TagDevice(fabric), None, cost, write_policy=write_policy), fabric


def _prefill(c: Controller, tokens: list[int]) -> None:
    """Admit, allocate and insert ``tokens``; release the request."""
    req = c.admit(tokens)
    pages = c.allocate(req, len(tokens) // PS - req.cached_len // PS)
    assert pages is not None
    c.insert(req, pages)
    c.release(req)


def test_allocate_names_a_bad_page_count() -> None:
    """A negative page count is refused with a MisuseError naming the call and the value."""
    c, _ = _make()
    req = c.admit([1, 2])
    with pytest.raises(MisuseError, match=r"^allocate: page count must be an int >= 0, got -1$"):
        c.allocate(req, -1)
    c.release(req)
    c.close()


def test_start_restore_after_allocate_names_the_request_and_its_state() -> None:
    """A restore asked for once the request is prefilling is refused, naming the request,
    its state and when a restore is allowed."""
    c, _ = _make()
    req = c.admit([1, 2])
    assert c.allocate(req, 1) is not None
    want = rf"^start_restore: request #{req.id} is prefilling; restore right after admit$"
    with pytest.raises(MisuseError, match=want):
        c.start_restore(req)
    c.release(req)
    c.close()


def test_a_restore_of_a_run_already_being_loaded_falls_back() -> None:
    """Two requests hit the same L2 run; while the first one's H2D is in flight the second
    cannot start one: start_restore returns None, the request is ready to prefill and one
    fallback is counted."""
    c, _ = _make()
    tokens = list(range(6))
    _cached(c, tokens, Tier.L1)
    first, second = c.admit(tokens), c.admit(tokens)
    assert first.hit == second.hit == (0, 6, 6)
    pending = c.start_restore(first)
    assert pending is not None and pending.stage == "h2d"
    assert c.start_restore(second) is None
    assert second.state is ReqState.READY and second.restore is None
    assert c.metrics.fallbacks == 1
    c.release(first)
    c.release(second)
    c.close()


class _Unavailable(TagStorage):
    """A store that is never reachable."""

    @property
    def available(self) -> bool:
        return False


def test_each_backup_an_unavailable_store_misses_is_counted() -> None:
    """Two runs backed up to L2 while the store is unreachable: l3_unavailable is 2."""
    c, _ = _make(storage=_Unavailable(TagFabric(TierSizes(8, 8, 16).capacities)))
    _cached(c, [1, 2])
    _cached(c, [3, 4])
    assert c.metrics.l3_unavailable == 2
    c.close()


@dataclass(slots=True)
class _Timings:
    """A copy's timings: fixed, distinct, exact in binary."""

    enqueue_s: float = 0.5
    setup_s: float = 0.25
    queue_s: float = 0.125
    service_s: float = 1.0
    complete_s: float = 0.0
    total_s: float = 2.0

    @property
    def recurring_s(self) -> float:
        return 1.5


def test_per_direction_timings_add_up_over_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two D2H copies with the same timings report twice each timing under D2H."""
    monkeypatch.setattr(TagTicket, "timings", property(lambda self: _Timings()))
    c, _ = _make_without_storage()
    _cached(c, [1, 2])
    _cached(c, [3, 4])
    d2h = c.metrics.directions["D2H"]
    assert d2h.count == 2
    assert (d2h.enqueue_s, d2h.setup_s, d2h.queue_s, d2h.service_s, d2h.total_s) == (1.0, 0.5, 0.25, 2.0, 4.0)
    assert d2h.steady_s == 3.0
    c.close()


def test_the_pending_transfer_gauge_counts_a_backup_in_flight() -> None:
    """With one D2H backup in flight and no restore, Prometheus shows one pending backup
    and no pending restore."""
    c, fabric = _make()
    _prefill(c, [1, 2])
    assert [t.direction for t in fabric.queue] == [Direction.D2H]
    text = c.prometheus()
    assert '\nhicache_pending_transfers{kind="backup"} 1.0\n' in text
    assert '\nhicache_pending_transfers{kind="restore"} 0.0\n' in text
    c.close()


def test_close_withdraws_a_backup_not_yet_started() -> None:
    """A D2H backup still queued at close is withdrawn, not run: nothing lands in L2 and
    no D2H is counted."""
    c, fabric = _make()
    tokens = [1, 2, 3, 4]
    _prefill(c, tokens)
    assert len(fabric.queue) == 1
    c.close()
    assert fabric.queue == []
    assert c.core.match(tokens).lengths == (4, 0, 0)
    assert c.metrics.directions["D2H"].count == 0


def test_a_deferred_backup_ends_once_its_run_holds_the_copy() -> None:
    """A backup deferred behind a D2H above it, then made by the D2H of the run below it,
    is done: evicting that L2 copy afterwards and finishing another transfer starts no D2H
    for it again (write-through backs a run up when inserted, not after each eviction)."""
    c, fabric = _make_without_storage()
    _prefill(c, [0, 1, 2, 3])  # run X; its D2H stays queued
    short = c.admit([0, 1, 2, 3, 4, 5, 6, 7])  # hits X
    _prefill(c, list(range(12)))  # run M below X: its backup waits for X's
    pages = c.allocate(short, 2)
    assert pages is not None
    c.insert(short, pages)  # splits M at 8: its upper half N waits for X's backup too
    c.release(short)
    assert len(fabric.queue) == 1
    _finish_queued(c, fabric)  # X lands; M's retry moves N and M together
    assert [t.direction for t in fabric.queue] == [Direction.D2H] and len(fabric.queue[0].dst) == 4
    _finish_queued(c, fabric)
    assert c.core.match(list(range(12))).lengths == (12, 12, 0)
    c.core.evict(Tier.L2, 10**6)
    assert c.core.match(list(range(12))).lengths == (12, 0, 0)
    _prefill(c, [90, 91])
    assert len(fabric.queue) == 1
    _finish_queued(c, fabric)
    assert fabric.queue == [] and c.status().pending_backups == 0
    c.close()
