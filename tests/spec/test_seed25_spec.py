"""Spec contracts: the structure check keeps walking past a bad child, the guards' own
consistency check names the transition, a layered restore outside LOADING_L2 is reported."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hicache.spec import model
from hicache.spec.invariants import Violation, structure
from hicache.spec.model import Direction, Tier
from hicache.spec.request import ReqState
from hicache.spec.request_invariants import check_requests
from tests.spec.test_invariants import base
from tests.spec.test_request_invariants import base as request_base


def test_a_missing_child_listed_first_does_not_hide_its_siblings() -> None:
    """A child id not in the tree, listed before a node's real children, is the only
    structure report: the real children are still walked (none is called unreachable)."""
    b = base()
    s = b.snap
    u = s.nodes[b.u]
    bad = replace(s, nodes={**s.nodes, b.u: replace(u, children=(((9, 9), 999), *u.children))})
    assert structure(bad) == [
        Violation("structure", f"node #{b.u}", "child #999 is not in the tree", "structure.missing-child")
    ]


def test_a_child_reached_twice_does_not_hide_the_children_after_it() -> None:
    """The root listing leaf c twice, both before its other child, reports c reached twice
    and the root's wrong L1 child count, and nothing else: the later child is still walked."""
    b = base()
    s = b.snap
    root = s.nodes[s.root]
    c = next(kc for kc in root.children if kc[1] == b.c)
    rest = tuple(kc for kc in root.children if kc[1] != b.c)
    bad = replace(s, nodes={**s.nodes, s.root: replace(root, children=(c, c, *rest))})
    assert structure(bad) == [
        Violation("structure", f"node #{b.c}", "reached twice", "structure.reached-twice"),
        Violation("structure", f"node #{s.root}", "stored L1 child count 2 != 3", "structure.tier-children"),
    ]


def test_a_guard_leading_outside_the_declared_states_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """With may_start ignoring residency, _declare stops at the first guard leading to an
    undeclared (R, F) and names it: an H2S from a run in L1 only (H2S needs L2, DESIGN §4)."""
    monkeypatch.setattr(model, "may_start", lambda d, r, f: d not in f)
    with pytest.raises(RuntimeError) as info:
        list(model._declare())
    assert str(info.value) == (
        "guard leads outside the declared states: L1 --start_h2s--> "
        f"({frozenset({Tier.L1})}, {frozenset({Direction.H2S})})"
    )


@pytest.mark.parametrize("state", [ReqState.LOADING_L3, ReqState.RUNNING])
def test_layered_pages_outside_an_l2_load_are_reported(state: ReqState) -> None:
    """The layered restore, its H2D and prefix intact but its request in another state
    than LOADING_L2, is reported as layered without an H2D (layering is an L2 load's)."""
    b = request_base()
    assert b.snap.requests is not None and b.loading.restore_pages is not None
    moved = replace(b.loading, state=state)
    snap = replace(b.snap, requests={**b.snap.requests, moved.id: moved})
    layered = [v for v in check_requests(snap) if v.invariant == "request-restore-pages"]
    assert [(v.code, v.where) for v in layered] == [
        ("request-restore-pages.layered-without-h2d", f"request #{moved.id}")
    ]
