"""A mover's ticket that raises from ``poll``, ``wait``, ``cancel`` or ``settle`` (a bug in an
embedder's mover): the exception never leaves the controller; that transfer fails, the
request recomputes, the tree stays consistent and a later restore with a sound ticket is
bit-exact."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from hicache.facade import HiCache
from hicache.spec.model import Tier
from tests.core.test_controller import cached, drain, evict_all, make, prefill


class _Raising:
    """Wraps a real ticket; ``method`` raises (every call) while ``armed``. When that is
    ``wait`` or ``settle``, the ticket reports its copy still running (``poll`` False, ``ok``
    None), so the calls that block are reached."""

    def __init__(self, ticket: Any, method: str) -> None:
        self._ticket, self._method, self.armed = ticket, method, True

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._ticket, name)
        if name == self._method and self.armed:

            def boom(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(f"{name} exploded")

            return boom
        if self._method in ("wait", "settle") and self.armed:
            if name == "poll":
                return lambda: False
            if name == "ok":
                return None
        return attr


def _wrap(monkeypatch: pytest.MonkeyPatch, c: HiCache, direction: str, method: str) -> list[_Raising]:
    """Every ``direction`` ticket the mover issues from now on raises from ``method``."""
    issue = getattr(c.device, direction)
    made: list[_Raising] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        made.append(_Raising(issue(*args, **kwargs), method))
        return made[-1]

    monkeypatch.setattr(c.device, direction, wrapped)
    return made


def _restored_after_recovery(c: HiCache, tokens: list[int], kv: torch.Tensor) -> None:
    """The prefix is still in L2 and a restore with sound tickets hands back its pages."""
    c.check_integrity()
    evict_all(c, Tier.L1)
    req = c.admit(tokens)
    assert c.restore(req)
    assert torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv)
    c.release(req)


@pytest.mark.parametrize("method", ["poll", "wait"])
def test_an_h2d_ticket_that_raises_fails_only_its_restore(
    method: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with make() as c:
        tokens = list(range(10))
        kv = cached(c, tokens, Tier.L1)
        made = _wrap(monkeypatch, c, "h2d", method)
        req = c.admit(tokens)
        with caplog.at_level(logging.WARNING, logger="hicache.core.controller"):
            if method == "wait":
                assert c.restore(req) is False
            else:
                pending = c.start_restore(req)
                assert pending is not None
                assert c.poll() == [pending]
                assert pending.outcome is not None and pending.outcome.value == "failed"
                assert pending.error == "the H2D ticket raised RuntimeError('poll exploded')"
        assert made and f"hicache: H2D ticket raised: RuntimeError('{method} exploded')" in caplog.messages
        assert req.cached_len == 0  # nothing published: the request recomputes
        assert c.status().metrics["directions"]["H2D"]["failed"] == 1
        c.release(req)
        monkeypatch.undo()
        _restored_after_recovery(c, tokens, kv)


@pytest.mark.parametrize("method", ["poll", "wait"])
def test_a_d2h_ticket_that_raises_fails_only_its_backup(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with make() as c:
        _wrap(monkeypatch, c, "d2h", method)
        tokens = list(range(10))
        req, kv = prefill(c, tokens)
        c.release(req)
        if method == "wait":
            c.drain()
        else:
            drain(c)
        assert c.status().metrics["directions"]["D2H"]["failed"] >= 1
        assert c.core.match(tokens).lengths[1] == 0  # no L2 copy was published
        c.check_integrity()
        monkeypatch.undo()
        req = c.admit(tokens)
        assert req.cached_len == 10 and torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv)
        c.release(req)


def test_a_cancel_that_raises_is_taken_as_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Released while its copy is in flight, with a ticket whose cancel raises: release
    returns, the copy completes into the tree, nothing is freed under it."""
    with make() as c:
        tokens = list(range(10))
        kv = cached(c, tokens, Tier.L1)
        made = _wrap(monkeypatch, c, "h2d", "cancel")
        req = c.admit(tokens)
        pending = c.start_restore(req)
        assert pending is not None and made
        c.release(req)
        drain(c)
        c.check_integrity()
        monkeypatch.undo()
        req = c.admit(tokens)
        assert req.cached_len == 10 and torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv)
        c.release(req)


def test_a_settle_that_raises_returns_false_and_poll_fails_the_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    with make() as c:
        tokens = list(range(10))
        kv = cached(c, tokens, Tier.L1)
        made = _wrap(monkeypatch, c, "h2d", "settle")
        req = c.admit(tokens)
        pending = c.start_restore(req)
        assert pending is not None and made
        assert c.settle() is False  # the ticket's settle raised
        made[0].armed = False
        while not pending.finished:
            c.poll()
        c.release(req)
        monkeypatch.undo()
        _restored_after_recovery(c, tokens, kv)


def test_a_wait_that_returns_early_fails_the_transfer_instead_of_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ticket whose ``wait`` returns while its ``poll`` still says running: the blocking
    calls (``restore``, ``drain``, ``close``) fail that transfer rather than loop forever."""
    with make() as c:
        tokens = list(range(10))
        kv = cached(c, tokens, Tier.L1)
        made = _wrap(monkeypatch, c, "h2d", "wait")
        req = c.admit(tokens)
        pending = c.start_restore(req)
        assert pending is not None and made
        made[0]._method = "none"  # wait returns, poll still False
        made[0].__dict__["poll"] = lambda: False
        c.drain()
        assert c.poll() == [pending] and pending.error == "the H2D ticket's wait returned before its copy finished"
        c.release(req)
        monkeypatch.undo()
        _restored_after_recovery(c, tokens, kv)


class _RaisingField:
    """Wraps a real ticket; reading ``field`` (``ok``, ``error``, ``timings``, ...) raises
    once its copy has landed (the controller reads them then)."""

    def __init__(self, ticket: Any, field: str) -> None:
        self._ticket, self._field = ticket, field

    def __getattr__(self, name: str) -> Any:
        if name == self._field:
            raise RuntimeError(f"{name} exploded")
        return getattr(self._ticket, name)


@pytest.mark.parametrize("field", ["ok", "error", "timings", "nbytes", "extents"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_a_ticket_whose_outcome_or_figures_raise_never_leaves_the_controller(
    field: str, direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a landed ticket's ``ok`` or ``error`` that raises fails its transfer; its
    ``timings``, ``nbytes`` or ``extents`` that raise lose only its figures (the copy is
    sound). Either way nothing raises out of ``poll`` / ``drain``, nothing stays in flight,
    and the pages served afterwards are the pages written."""
    with make() as c:
        tokens = list(range(10))
        kv = cached(c, tokens, Tier.L1) if direction == "h2d" else None
        issue = getattr(c.device, direction)
        monkeypatch.setattr(c.device, direction, lambda *a, **k: _RaisingField(issue(*a, **k), field))
        fails = field in ("ok", "error")
        if direction == "h2d":
            req = c.admit(tokens)
            pending = c.start_restore(req)
            assert pending is not None
            while not pending.finished:
                c.poll()
            assert pending.done is not fails and req.cached_len == (0 if fails else 10)
            c.release(req)
        else:
            req, kv = prefill(c, tokens)
            c.release(req)
            c.drain()
            assert c.core.match(tokens).lengths[1] == (0 if fails else 10)  # backed up unless it failed
        st = c.status()
        assert not any(st.core.transfers_in_flight.values())
        assert st.metrics["directions"][direction.upper()]["failed"] == (1 if fails else 0)
        c.check_integrity()
        monkeypatch.undo()
        assert kv is not None
        if direction == "d2h" and fails:  # no L2 copy: the pages are the tree's in L1
            req = c.admit(tokens)
            assert req.cached_len == 10 and torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv)
            c.release(req)
        else:
            _restored_after_recovery(c, tokens, kv)
