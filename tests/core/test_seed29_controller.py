"""Controller contracts the seed-29 mutation draw found unchecked: refusals that name the
call and the bad value's type, failed copies counted each time, the transfer mover's status,
the pending-restore gauge, which pages count as verified, and close withdrawing a queued
write-through to L3. The movers hold every copy until told (hicache.testing.tag_movers)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from hicache.core.cache import CacheCore
from hicache.core.controller import Controller
from hicache.core.cost import CostModel, CostPriors
from hicache.core.geometry import TierSizes
from hicache.errors import MisuseError
from hicache.spec.model import Direction, Tier
from hicache.testing.tag_movers import TagDevice, TagFabric, TagStorage
from tests.core.test_seed26_controller import PS, _cached, _make
from tests.core.test_seed28_controller import _finish_queued, _prefill

_REFUSALS: list[tuple[str, Callable[[Controller, object], object]]] = [
    (r"^insert: pages must be a sequence of page ids, got int$", lambda c, req: c.insert(req, 5)),  # type: ignore[arg-type]
    (r"^note_decode: seconds must be a number in \[0, 86400\], got -1\.0$", lambda c, req: c.note_decode(-1.0)),
    (
        r"^start_restore: plan must be a Plan from plan\(\), got str$",
        lambda c, req: c.start_restore(req, "L2"),  # type: ignore[arg-type]
    ),
]


@pytest.mark.parametrize(("want", "call"), _REFUSALS)
def test_a_refused_argument_is_named_with_its_call_and_type(
    want: str, call: Callable[[Controller, object], object]
) -> None:
    """A bad argument is refused with a MisuseError naming the call and the value's type
    (or the value), and the request can still go on (nothing changed)."""
    c, _ = _make()
    req = c.admit([1, 2])
    with pytest.raises(MisuseError, match=want):
        call(c, req)
    assert c.allocate(req, 1) is not None
    c.release(req)
    c.close()


def test_each_failed_copy_counts_one_failure_of_its_direction() -> None:
    """Two D2H backups whose copies fail: D2H counts two failures and no completed copy."""
    c, fabric = _make()
    _prefill(c, [1, 2])
    _prefill(c, [3, 4])
    assert [t.direction for t in fabric.queue] == [Direction.D2H, Direction.D2H]
    for ticket in list(fabric.queue):
        fabric.finish(ticket, ok=False)
    c.poll()
    d2h = c.metrics.directions[Direction.D2H.name]
    assert (d2h.count, d2h.failed) == (0, 2)
    c.check_integrity()
    c.close()


def test_status_reports_the_device_movers_status() -> None:
    """``status().transfer`` is what the device mover reports about itself."""
    c, _ = _make()
    assert c.status().transfer == {"backend": "tags"}
    c.close()


def test_the_pending_transfer_gauge_counts_a_restore_in_flight_once() -> None:
    """With one restore's H2D in flight and no backup, Prometheus shows one pending
    restore and no pending backup."""
    c, fabric = _make()
    tokens = list(range(6))
    _cached(c, tokens, Tier.L1)
    req = c.admit(tokens)
    pending = c.start_restore(req)
    assert pending is not None and [t.direction for t in fabric.queue] == [Direction.H2D]
    text = c.prometheus()
    assert '\nhicache_pending_transfers{kind="restore"} 1.0\n' in text
    assert '\nhicache_pending_transfers{kind="backup"} 0.0\n' in text
    c.release(req)
    c.close()


class _AcceptAll:
    """A page verifier that finds every page good and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[Direction, int]] = []

    def verify(self, direction: Direction, src: Sequence[int], dst: Sequence[int]) -> str | None:
        self.asked.append((direction, len(dst)))
        return None

    def forget_slots(self, slots: Sequence[int]) -> None:
        pass


def _build(store: type[TagStorage] = TagStorage, verifier: _AcceptAll | None = None) -> tuple[Controller, TagFabric]:
    """A controller whose device and store share one fabric (L1 8, L2 8, L3 16 pages)."""
    sizes = TierSizes(8, 8, 16)
    fabric = TagFabric(sizes.capacities)
    cost = CostModel(1, CostPriors(), "always")
    c = Controller(CacheCore(PS, sizes, tracing=True), TagDevice(fabric), store(fabric), cost, verifier=verifier)
    return c, fabric


def test_a_write_to_storage_is_not_counted_as_verified_pages() -> None:
    """An H2S copy is only recorded by the verifier, not checked: a 2-page run written
    through L2 to L3 counts its 2 D2H pages as verified, not its H2S pages."""
    verifier = _AcceptAll()
    c, _ = _build(verifier=verifier)
    _cached(c, [1, 2, 3, 4])
    assert verifier.asked == [(Direction.D2H, 2), (Direction.H2S, 2)]
    assert c.metrics.verified_pages == 2
    c.close()


class _Persistent(TagStorage):
    """A store that outlives the cache."""

    @property
    def persistent(self) -> bool:
        return True


@pytest.mark.parametrize("persistent", [False, True])
def test_close_withdraws_a_queued_write_to_storage_unless_the_store_persists(persistent: bool) -> None:
    """An H2S backup still queued at close is withdrawn (nothing lands in L3, no H2S counted)
    when the store dies with the cache, and written (one H2S) when the store persists."""
    c, fabric = _build(_Persistent if persistent else TagStorage)
    tokens = [1, 2, 3, 4]
    _prefill(c, tokens)
    _finish_queued(c, fabric)  # the D2H lands; the H2S is queued
    assert [t.direction for t in fabric.queue] == [Direction.H2S]
    c.close()
    assert fabric.queue == []
    assert c.core.match(tokens).lengths == ((4, 4, 4) if persistent else (4, 4, 0))
    assert c.metrics.directions[Direction.H2S.name].count == (1 if persistent else 0)
