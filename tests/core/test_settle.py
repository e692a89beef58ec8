"""Controller.settle: an engine with nothing to run blocks on the first restore copy to the
device instead of polling it, and never on storage I/O or a backup. The movers hold every
copy until told (hicache.testing.tag_movers); a settle-able ticket records the calls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from hicache.core.cache import CacheCore
from hicache.core.controller import Controller
from hicache.core.cost import CostModel, CostPriors
from hicache.core.geometry import TierSizes
from hicache.errors import MisuseError
from hicache.spec.model import Direction, Tier
from hicache.testing.tag_movers import TagDevice, TagFabric, TagStorage, TagTicket
from tests.core.test_seed26_controller import PS, _cached


class _Settled(TagTicket):
    """A device copy that can be waited for without its completion work (as DeviceTicket)."""

    calls: list[_Settled]

    def settle(self) -> bool:
        self.calls.append(self)
        return True


class _SettleDevice(TagDevice):
    def __init__(self, fabric: TagFabric) -> None:
        super().__init__(fabric)
        self.calls: list[_Settled] = []

    def h2d(self, src: Sequence[int], dst: Sequence[int], layer_events: Sequence[Any] | None = None) -> TagTicket:
        ticket = self.fabric.issue(Direction.H2D, src, dst)
        ticket.__class__ = _Settled
        assert isinstance(ticket, _Settled)
        ticket.calls = self.calls
        return ticket


class _SettleStorage(TagStorage):
    """Storage whose reads could be waited for too: settle must still leave them alone."""

    def __init__(self, fabric: TagFabric, calls: list[_Settled]) -> None:
        super().__init__(fabric)
        self.calls = calls

    def read(
        self,
        slots: Sequence[int],
        host_pages: Sequence[int],
        keys: Sequence[bytes] | None = None,
        *,
        above: Sequence[bytes] = (),
    ) -> TagTicket:
        ticket = super().read(slots, host_pages, keys, above=above)
        ticket.__class__ = _Settled
        assert isinstance(ticket, _Settled)
        ticket.calls = self.calls
        return ticket


def _make(device: type[TagDevice] = _SettleDevice) -> tuple[Controller, TagFabric, TagDevice]:
    sizes = TierSizes(16, 16, 32)
    fabric = TagFabric(sizes.capacities)
    dev = device(fabric)
    core = CacheCore(PS, sizes)
    store = _SettleStorage(fabric, dev.calls if isinstance(dev, _SettleDevice) else [])
    return Controller(core, dev, store, CostModel(1, CostPriors(), "always")), fabric, dev


def _restoring(c: Controller, tokens: list[int]) -> TagTicket:
    req = c.admit([*tokens, 99])
    pending = c.start_restore(req)
    assert pending is not None and pending.transfer is not None
    return c._jobs[pending.transfer.id].ticket  # type: ignore[return-value]


def test_settle_blocks_on_the_first_of_the_restore_copies_to_the_device() -> None:
    """Two restores copy L2 -> L1: settle waits for the one issued first, once, and says so;
    the copies still end only through poll (settle runs no completion work)."""
    c, fabric, dev = _make()
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    _cached(c, a, Tier.L1)
    _cached(c, b, Tier.L1)
    first, second = _restoring(c, a), _restoring(c, b)
    assert isinstance(dev, _SettleDevice)
    assert c.settle() is True
    assert dev.calls == [first]
    assert first.ok is None and second.ok is None
    assert fabric.queue  # nothing landed by settling
    fabric.finish(first, ok=True)
    assert c.settle() is False  # a copy landed and waits for its poll: nothing to block on
    assert len(dev.calls) == 1
    assert len(c.poll()) == 1
    assert c.settle() is True and dev.calls[-1] is second


def test_settle_never_waits_on_storage_or_backups() -> None:
    """With a restore reading L3, or only a backup in flight, settle returns False at once."""
    c, _, dev = _make()
    a = [1, 2, 3, 4]
    _cached(c, a, Tier.L1, Tier.L2)
    read = _restoring(c, a)
    assert read.direction is Direction.S2H
    assert c.settle() is False
    c.drain()
    c2, fabric2, dev2 = _make()
    req = c2.admit([9, 8, 7, 6])
    pages = c2.allocate(req, 2)
    assert pages is not None
    c2.insert(req, pages)
    c2.release(req)
    assert fabric2.queue and all(t.direction is not Direction.H2D for t in fabric2.queue)
    assert c2.settle() is False
    assert isinstance(dev, _SettleDevice) and isinstance(dev2, _SettleDevice)
    assert dev.calls == [] and dev2.calls == []


def test_settle_waits_for_a_restore_beside_a_backup() -> None:
    """A backup (D2H) in flight beside a restore's H2D does not stop settle from waiting
    for the restore's copy."""
    c, fabric, dev = _make()
    a = [1, 2, 3, 4]
    _cached(c, a, Tier.L1)
    req = c.admit([9, 8, 7, 6])
    pages = c.allocate(req, 2)
    assert pages is not None
    c.insert(req, pages)
    c.release(req)  # its backup stays queued
    ticket = _restoring(c, a)
    assert {t.direction for t in fabric.queue} >= {Direction.D2H, Direction.H2D}
    assert c.settle() is True
    assert isinstance(dev, _SettleDevice) and dev.calls == [ticket]


def test_settle_without_a_settle_able_ticket_does_not_block() -> None:
    """A device mover whose tickets cannot be waited for apart from their completion: False."""
    c, _, _ = _make(TagDevice)
    a = [1, 2, 3, 4]
    _cached(c, a, Tier.L1)
    ticket = _restoring(c, a)
    assert ticket.direction is Direction.H2D
    assert c.settle() is False
    assert ticket.ok is None


def test_settle_on_a_closed_cache_is_misuse() -> None:
    """Like every call, settle on a closed cache raises MisuseError."""
    c, _, _ = _make()
    c.close()
    with pytest.raises(MisuseError, match="closed"):
        c.settle()


def test_settle_reports_no_wait_when_the_ticket_had_nothing_to_wait_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device ticket whose settle found no copy to wait for (it returns False) makes settle
    return False, so the engine sleeps instead of spinning on it."""
    c, _, dev = _make()
    a = [1, 2, 3, 4]
    _cached(c, a, Tier.L1)
    ticket = _restoring(c, a)
    monkeypatch.setattr(_Settled, "settle", lambda self: self.calls.append(self) and False)
    assert c.settle() is False
    assert isinstance(dev, _SettleDevice) and dev.calls == [ticket]
