"""Refusals and broken invariants raise the typed error that names the cause."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hicache.core import CacheCore, TierSizes
from hicache.core.controller import PendingRestore, Request
from hicache.core.cost import Plan
from hicache.core.tree import TierMatch
from hicache.errors import IntegrityError, PageOwnershipError, TransitionRefused
from hicache.spec.model import Event, RunState, Tier
from tests.core.test_controller import cached
from tests.core.test_controller import make as make_cache
from tests.core.test_integrity import break_closure, build


def test_insert_names_a_page_given_twice() -> None:
    """insert refuses a page listed twice with a PageOwnershipError saying so."""
    core = CacheCore(2, TierSizes(8, 8, 8))
    pages = core.allocate_l1(1)
    assert pages is not None
    with pytest.raises(PageOwnershipError, match="a page is given twice"):
        core.insert((1, 2, 3, 4), [pages[0], pages[0]])


def test_expect_from_names_the_event_and_state() -> None:
    """A transition the spec refuses for a run not in the tree names the event and state."""
    core = CacheCore(2, TierSizes(8, 8, 8))
    with pytest.raises(TransitionRefused, match="spec refuses 'complete_s2h' on a L1 run"):
        core.tree.expect_from(RunState.L1, Event.COMPLETE_S2H)


def test_a_path_missing_a_copy_is_a_prefix_closure_error() -> None:
    """Reading a tier's pages along a path whose ancestor lacks that copy raises
    IntegrityError('prefix-closure') naming the run and the tier."""
    core, a, b = build()
    break_closure(core, a, b)
    match = TierMatch(Tier.L3, 4, b, b.version[Tier.L3])
    reads: list[Callable[[], list[int]]] = [lambda: core.path_pages(b, Tier.L3), lambda: core.pages(match)]
    for read in reads:
        with pytest.raises(IntegrityError) as info:
            read()
        assert info.value.invariant == "prefix-closure"
        assert info.value.where == repr(b.parent)
        assert "L3 copy" in info.value.detail


def test_removing_a_run_with_children_is_a_structure_error() -> None:
    """tree.remove of an EMPTY run that still has children raises IntegrityError('structure')."""
    core, _, b = build()
    parent = b.parent
    assert parent is not None
    parent.pages[Tier.L1] = parent.pages[Tier.L2] = None  # EMPTY, yet a and b hang below it
    with pytest.raises(IntegrityError) as info:
        core.tree.remove(parent)
    assert info.value.invariant == "structure"
    assert info.value.where == repr(parent)


def test_a_blocking_restore_without_its_transfer_names_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """restore() raises IntegrityError('ordering') naming the request when the restore in
    flight has lost its transfer (a bug, simulated here)."""
    c = make_cache()
    tokens = list(range(8))
    cached(c, tokens, Tier.L1)
    req = c.admit(tokens)
    start = c.controller.start_restore

    def lose_transfer(r: Request, plan: Plan | None = None) -> PendingRestore | None:
        pending = start(r, plan)
        assert pending is not None and not pending.finished
        pending.transfer = None
        return pending

    monkeypatch.setattr(c.controller, "start_restore", lose_transfer)
    with pytest.raises(IntegrityError) as info:
        c.restore(req)
    assert (info.value.invariant, info.value.where) == ("ordering", f"request #{req.id}")


def test_the_controller_reports_a_single_broken_invariant() -> None:
    """With exactly one invariant broken, check_integrity raises it (invariant and place)."""
    c = make_cache()
    cached(c, list(range(8)))
    c.core.tree.evictable[Tier.L2] += 1
    bad = c.controller.violations()
    assert len(bad) == 1
    with pytest.raises(IntegrityError) as info:
        c.check_integrity()
    err = info.value
    assert (err.invariant, err.where, err.detail) == (bad[0].invariant, bad[0].where, bad[0].detail)
