"""Deferred H2Ds (``TransferEngine.deferring``), on CPU: an H2D with layer events made inside
the block changes nothing until it is queued (by ``flush``, its ticket, or the next
transfer), then lands bit-exact with each event recorded once; a queuing that fails fails
the ticket instead of raising; transfers keep the order they were made in."""

from __future__ import annotations

import random
import signal
from typing import Any

import pytest
import torch

from hicache.backends import kernels
from hicache.backends import transfer as transfer_module
from hicache.backends.transfer import TransferEngine
from hicache.core import interrupts
from tests.backends.test_ring import FakeEvent, engine, no_room_for_the_ring, pools

LAYERS = 5


def setup(monkeypatch: pytest.MonkeyPatch, *, layered: bool = True, **kw: Any) -> tuple[Any, Any, TransferEngine]:
    if layered:
        monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    l1, l2 = pools(24, layers=LAYERS)
    kw.setdefault("layer_group", 1)
    kw.setdefault("max_layer_group", 2)
    return l1, l2, engine(l1, l2, 4, 2, **kw)


def restore(l1: Any, l2: Any, seed: int, n: int = 7) -> tuple[list[int], list[int], torch.Tensor]:
    """Random L2 sources and L1 destinations of ``n`` pages, L1 zeroed; the bytes wanted."""
    rng = random.Random(seed)
    src, dst = rng.sample(range(24), n), rng.sample(range(24), n)
    l1.slabs.zero_()
    return src, dst, l2.slabs[src].clone()


def in_l1(l1: Any, dst: list[int]) -> torch.Tensor:
    got: torch.Tensor = l1.slabs[:, dst].transpose(0, 1)
    return got


def state(ticket: Any) -> bool | None:
    """``ticket.ok`` read afresh (a call: mypy keeps no narrowing across it)."""
    ok: bool | None = ticket.ok
    return ok


def counting_events(l1: Any, dst: list[int], want: torch.Tensor) -> list[FakeEvent]:
    def landed() -> frozenset[int]:
        got = in_l1(l1, dst)
        return frozenset(x for x in range(LAYERS) if torch.equal(got[:, [x, LAYERS + x]], want[:, [x, LAYERS + x]]))

    return [FakeEvent(landed) for _ in range(LAYERS)]


@pytest.mark.parametrize("layered", [True, False], ids=["layered", "copy-path"])
@pytest.mark.parametrize(
    "how", ["flush", "poll", "wait", "next-transfer", "synchronize", "settle", "wait_on_current_stream"]
)
def test_a_deferred_h2d_changes_nothing_until_queued_then_lands_exactly(
    monkeypatch: pytest.MonkeyPatch, layered: bool, how: str
) -> None:
    l1, l2, eng = setup(monkeypatch, layered=layered)
    src, dst, want = restore(l1, l2, seed=3)
    events = counting_events(l1, dst, want)
    with eng.deferring():
        ticket = eng.h2d(src, dst, layer_events=events)
    assert state(ticket) is None and not torch.count_nonzero(in_l1(l1, dst))
    assert all(not e.records for e in events)
    if how == "flush":
        eng.flush()
    elif how == "poll":
        assert ticket.poll()
    elif how == "wait":
        assert ticket.wait()
    elif how == "next-transfer":
        assert eng.d2h([0], [0]).wait()  # another transfer queues the deferred one first
    elif how == "settle":
        ticket.settle()
    elif how == "wait_on_current_stream":
        ticket.wait_on_current_stream()
    else:
        eng.synchronize()
    assert ticket.wait() and state(ticket)
    assert torch.equal(in_l1(l1, dst), want)
    assert all(len(e.records) == 1 for e in events)  # each once
    assert events[-1].records[0] == frozenset(range(LAYERS))
    eng.flush()  # nothing left: no second record
    assert all(len(e.records) == 1 for e in events)


def test_a_transfer_made_after_a_deferred_h2d_sees_its_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A D2H of the restored pages made before any flush copies what the H2D brought."""
    l1, l2, eng = setup(monkeypatch)
    src, dst, want = restore(l1, l2, seed=5, n=4)
    back = [p for p in range(24) if p not in src][:4]
    with eng.deferring():
        h2d = eng.h2d(src, dst, layer_events=counting_events(l1, dst, want))
        d2h = eng.d2h(dst, back)
    assert d2h.wait() and h2d.wait()
    assert torch.equal(l2.slabs[back], want)


def test_only_h2ds_with_layer_events_are_deferred(monkeypatch: pytest.MonkeyPatch) -> None:
    l1, l2, eng = setup(monkeypatch)
    src, dst, want = restore(l1, l2, seed=7)
    with eng.deferring():
        ticket = eng.h2d(src, dst)
        assert ticket.ok  # queued (and on CPU run) at once
    assert torch.equal(in_l1(l1, dst), want)


def test_deferring_ends_with_its_block(monkeypatch: pytest.MonkeyPatch) -> None:
    l1, l2, eng = setup(monkeypatch)
    with eng.deferring():
        pass
    src, dst, want = restore(l1, l2, seed=9)
    assert eng.h2d(src, dst, layer_events=counting_events(l1, dst, want)).ok
    assert torch.equal(in_l1(l1, dst), want)


@pytest.mark.parametrize("where", ["_issue_straight", "_issue", "_layer_dmas"])
def test_a_deferred_h2d_that_cannot_be_queued_fails_its_ticket_and_raises_nothing(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The queuing raises part-way (a driver error): ``flush`` returns, the ticket fails with
    the reason, and the engine goes on: the next H2D lands exactly."""
    l1, l2, eng = setup(monkeypatch, straight_runs=0 if where != "_issue_straight" else 8)
    src, dst, want = restore(l1, l2, seed=11, n=6)
    if where == "_issue_straight":
        src, dst = list(range(2, 8)), list(range(10, 16))  # one run in both pools: straight
        want = l2.slabs[src].clone()
    real = getattr(TransferEngine, where)
    calls = {"n": 0}

    def broken(self: TransferEngine, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2 or where != "_layer_dmas":  # _layer_dmas: its second call raises, part-way
            raise RuntimeError("cudaMemcpy2DAsync failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TransferEngine, where, broken)
    with eng.deferring():
        ticket = eng.h2d(src, dst, layer_events=counting_events(l1, dst, want))
    eng.flush()
    assert calls["n"] >= 1
    assert ticket.wait() is False and ticket.ok is False
    assert ticket.error is not None and "cudaMemcpy2DAsync failed" in ticket.error
    monkeypatch.setattr(TransferEngine, where, real)
    src, dst, want = restore(l1, l2, seed=12, n=6)
    assert eng.h2d(src, dst, layer_events=counting_events(l1, dst, want)).wait()
    assert torch.equal(in_l1(l1, dst), want)


def test_a_deferred_h2d_without_room_for_the_ring_fails_its_ticket(monkeypatch: pytest.MonkeyPatch) -> None:
    l1, l2, eng = setup(monkeypatch, straight_runs=0)
    src, dst, want = restore(l1, l2, seed=13)
    no_room_for_the_ring(monkeypatch, l1)
    with eng.deferring():
        ticket = eng.h2d(src, dst, layer_events=counting_events(l1, dst, want))
    assert state(ticket) is None
    assert ticket.poll() and state(ticket) is False and "ring" in (ticket.error or "")
    assert eng.allocation_failures == 1


def test_deferred_h2ds_are_queued_in_the_order_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two deferred H2Ds into the same L1 pages: the later one's bytes win."""
    l1, l2, eng = setup(monkeypatch)
    dst = [3, 4, 5]
    l1.slabs.zero_()
    with eng.deferring():
        first = eng.h2d([10, 11, 12], dst, layer_events=counting_events(l1, dst, l2.slabs[[10, 11, 12]]))
        second = eng.h2d([20, 21, 22], dst, layer_events=counting_events(l1, dst, l2.slabs[[20, 21, 22]]))
    assert second.wait() and first.ok
    assert torch.equal(in_l1(l1, dst), l2.slabs[[20, 21, 22]])


@pytest.mark.parametrize("after", [1, 2, 3, 99])
def test_flush_calls_midway_once_the_first_groups_are_queued(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """``midway`` runs once, when ``after`` layer groups have landed (CPU: queued is landed),
    or at the end when there are fewer; the H2D then lands whole."""
    l1, l2, eng = setup(monkeypatch)
    groups = eng.layer_groups()
    src, dst, want = restore(l1, l2, seed=17)
    events = counting_events(l1, dst, want)
    seen: list[list[int]] = []
    with eng.deferring():
        ticket = eng.h2d(src, dst, layer_events=events)
    eng.flush(lambda: seen.append([len(e.records) for e in events]), after=after)
    done = min(after, len(groups))
    landed = [1 if x < groups[done - 1][1] else 0 for x in range(LAYERS)]
    assert seen == [landed]
    assert ticket.wait() and torch.equal(in_l1(l1, dst), want)
    eng.flush(lambda: seen.append([]))  # nothing deferred: called at once, at the end
    assert seen == [landed, []]


def test_a_midway_that_raises_raises_after_the_h2d_is_queued_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    l1, l2, eng = setup(monkeypatch)
    src, dst, want = restore(l1, l2, seed=19)
    events = counting_events(l1, dst, want)
    with eng.deferring():
        ticket = eng.h2d(src, dst, layer_events=events)

    def launch() -> None:
        raise torch.OutOfMemoryError("no memory for the forward")

    with pytest.raises(torch.OutOfMemoryError):
        eng.flush(launch, after=1)
    assert ticket.wait() and torch.equal(in_l1(l1, dst), want)
    assert all(len(e.records) == 1 for e in events)
    eng.flush()  # the error was raised once: nothing left over


def test_a_worker_flushing_while_the_last_deferred_h2d_is_queued_leaves_the_midway_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An I/O worker's ``settle`` flushes too. Landing while the scheduler queues the last
    deferred H2D (none left pending), it must leave that flush's ``midway`` (the forward's
    launch) alone: the launch is made once, by the scheduler."""
    import threading

    l1, l2, eng = setup(monkeypatch)
    src, dst, want = restore(l1, l2, seed=7)
    with eng.deferring():
        ticket = eng.h2d(src, dst, layer_events=counting_events(l1, dst, want))
    real = TransferEngine._issue

    def issue(self: TransferEngine, *args: Any, **kwargs: Any) -> Any:
        assert not self._pending  # the last one, being queued
        worker = threading.Thread(target=self.flush)
        worker.start()
        worker.join(timeout=30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TransferEngine, "_issue", issue)
    launches: list[int] = []
    eng.flush(midway=lambda: launches.append(1))
    assert launches == [1]
    assert ticket.wait() and torch.equal(in_l1(l1, dst), want)


class Timeout(Exception):
    """What a timeout's SIGALRM handler raises."""


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="no SIGALRM here")
@pytest.mark.parametrize("where", ["_issue", "autotune", "index-buffers"])
def test_a_signal_handlers_exception_while_a_copy_is_queued_reaches_the_caller(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A timeout's SIGALRM handler raising while a deferred H2D is queued, or while the
    first transfer sets up (the kernels' autotune, the index buffers), is the caller's: it
    comes out of the call, not taken for the copy's failure (a ticket failed 'could not be
    queued', a Triton fallback, a failed allocation) and swallowed. The ticket fails as
    interrupted, and the next H2D lands exactly."""
    l1, l2, eng = setup(monkeypatch, straight_runs=0)
    fired = [0]

    def timeout(signum: int, frame: object) -> None:
        fired[0] += 1
        raise Timeout

    target, name = {
        "_issue": (TransferEngine, "_issue"),
        "autotune": (kernels, "gather_torch"),
        "index-buffers": (transfer_module, "_Ids"),
    }[where]
    real = getattr(target, name)

    def signalled(*args: Any, **kwargs: Any) -> Any:
        if not fired[0]:
            signal.raise_signal(signal.SIGALRM)
        return real(*args, **kwargs)

    before = signal.signal(signal.SIGALRM, timeout)
    held = interrupts.hold_signals()  # NOTE: as an open cache does: a handler's exception is known as one
    try:
        assert held
        src, dst, want = restore(l1, l2, seed=23)
        if where != "_issue":
            eng.requested = "auto"  # NOTE: with Triton usable, the first transfer's setup times both
            with monkeypatch.context() as m:
                m.setattr(eng, "triton_usable", True)
                m.setattr(target, name, signalled)
                with pytest.raises(Timeout):
                    eng.h2d(src, dst)
            assert eng.allocation_failures == 0 and eng.gather_backend is None
        else:
            with eng.deferring():
                ticket = eng.h2d(src, dst, layer_events=counting_events(l1, dst, want))
            monkeypatch.setattr(target, name, signalled)
            with pytest.raises(Timeout):
                eng.flush()
            monkeypatch.setattr(target, name, real)
            assert ticket.wait() is False and "interrupted" in (ticket.error or "")
        assert fired[0] == 1
    finally:
        interrupts.release_signals()
        signal.signal(signal.SIGALRM, before)
    src, dst, want = restore(l1, l2, seed=29)
    assert eng.h2d(src, dst, layer_events=counting_events(l1, dst, want)).wait()
    assert torch.equal(in_l1(l1, dst), want)
