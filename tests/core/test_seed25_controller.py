"""Controller contracts the seed-25 mutation draw found unchecked: refusals that name the
call, the log line of a mover that cannot issue, and the enqueue-seconds counter."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from hicache.errors import MisuseError
from hicache.spec.model import Tier
from tests.core.test_controller import cached, make


def test_plan_after_the_restore_was_decided_is_refused_by_name() -> None:
    """plan() is for a request right after admit: once start_restore has moved it on, plan
    is refused naming the call, the request and its state."""
    with make() as c:
        req = c.admit([1, 2, 3, 4])
        assert c.start_restore(req) is None  # nothing cached: the request is ready
        with pytest.raises(MisuseError, match=rf"^plan: request #{req.id} is ready; plan right after admit$"):
            c.plan(req)
        c.release(req)


def test_a_mover_that_releases_the_request_while_issuing_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device mover that re-enters the controller and releases the request while its
    restore's copy is issued: start_restore refuses loudly, naming the restore, the request,
    its state and the step; the copy still lands in the tree and integrity holds."""
    with make() as c:
        tokens = list(range(8))
        cached(c, tokens, Tier.L1)
        req = c.admit(tokens)
        issue = c.device.h2d

        def releasing(*args: Any, **kwargs: Any) -> Any:
            c.release(req)
            return issue(*args, **kwargs)

        monkeypatch.setattr(c.device, "h2d", releasing)
        refused = rf"^restore: request #{req.id} is released; 'start_l2' is not allowed there$"
        with pytest.raises(MisuseError, match=refused):
            c.start_restore(req)
        monkeypatch.undo()
        c.drain()
        c.check_integrity()
        assert c.admit(tokens).hit[0] == 8


def test_a_mover_that_cannot_issue_is_logged_with_its_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A mover that raises while issuing a copy is logged as a warning naming the direction
    and repeating the mover's exception."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no copy engine")

    with make() as c:
        monkeypatch.setattr(c.device, "d2h", refuse)
        req = c.admit([1, 2, 3, 4])
        pages = c.allocate(req, 2)
        assert pages is not None
        with caplog.at_level(logging.WARNING, logger="hicache.core.controller"):
            c.insert(req, pages)
        assert [r.getMessage() for r in caplog.records] == [
            "hicache: D2H could not be issued: RuntimeError('no copy engine')"
        ]
        c.release(req)


def test_enqueue_seconds_add_up_over_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-direction enqueue seconds are the sum of each completed transfer's."""
    with make() as c:
        issue = c.device.d2h

        def timed(*args: Any, **kwargs: Any) -> Any:
            ticket = issue(*args, **kwargs)
            ticket.timings.enqueue_s = 0.25  # a known value in place of the measured one
            return ticket

        monkeypatch.setattr(c.device, "d2h", timed)
        for start in (0, 10):
            req = c.admit(list(range(start, start + 4)))
            pages = c.allocate(req, 2)
            assert pages is not None
            c.insert(req, pages)
            c.release(req)
        c.drain()
        d2h = c.status().metrics["directions"]["D2H"]
        assert (d2h["count"], d2h["enqueue_s"]) == (2, 0.5)
