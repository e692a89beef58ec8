"""The request model: the compiled table agrees with the Machine, every state is reachable,
and each request invariant reports what it must on a corrupted snapshot."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.core.geometry import KVGeometry
from hicache.spec.model import Tier
from hicache.spec.request import REQUEST_TABLE, ReqEvent, ReqState, RequestMachine, request_reachable, request_step
from hicache.spec.request_invariants import check_requests
from hicache.spec.snapshot import RequestView, Snapshot

G = KVGeometry(2, 1, 4, 2, torch.float32)


def test_table_equals_machine_on_every_state_and_event() -> None:
    for state in ReqState:
        for event in ReqEvent:
            assert request_step(state, event) == RequestMachine.fire(state, event), (state, event)


def test_every_state_is_reachable_and_released_is_final() -> None:
    assert request_reachable() == set(ReqState)
    assert not any(s is ReqState.RELEASED for (s, _e) in REQUEST_TABLE)
    assert all(request_step(s, ReqEvent.RELEASE) is ReqState.RELEASED for s in ReqState if s is not ReqState.RELEASED)


def test_nothing_but_release_leaves_a_restore_in_flight() -> None:
    """A request's prefix is final before it may prefill: no allocate in LOADING_L3, no insert
    while loading; only publish, fail, promote and release end a restore."""
    for s in (ReqState.LOADING_L2, ReqState.LOADING_L3):
        assert request_step(s, ReqEvent.INSERT) is None
        assert request_step(s, ReqEvent.SKIP) is None
    assert request_step(ReqState.LOADING_L3, ReqEvent.ALLOCATE) is None
    assert request_step(ReqState.LOADING_L3, ReqEvent.PUBLISH) is None


def _restoring() -> tuple[HiCache, Snapshot]:
    """A cache with one request restoring (layered) and one running with private pages."""
    c = HiCache(HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu", policy="always"))
    a = c.admit([1, 2, 3, 4])
    pages = c.allocate(a, 2)
    assert pages is not None
    c.insert(a, pages)
    c.release(a)
    c.drain()
    c.core.evict(Tier.L1, 10**6)
    base = c.admit([1, 2, 9, 9, 9])
    more = c.allocate(base, 3)
    assert more is not None
    c.insert(base, more[:2])  # a RUNNING request holding one private page
    r = c.admit([1, 2, 3, 4, 5])
    assert r.hit == (2, 4, 0)
    pending = c.start_restore(r, layer_events=())
    assert pending is not None and pending.layered
    snap = c.controller.snapshot()
    assert check_requests(snap) == []
    return c, snap


def _edit(snap: Snapshot, which: ReqState, **change: object) -> Snapshot:
    assert snap.requests is not None
    rid = next(i for i, r in snap.requests.items() if r.state is which)
    requests = dict(snap.requests)
    requests[rid] = dataclasses.replace(requests[rid], **change)  # type: ignore[arg-type]
    return dataclasses.replace(snap, requests=requests)


def _view(snap: Snapshot, state: ReqState) -> RequestView:
    assert snap.requests is not None
    return next(r for r in snap.requests.values() if r.state is state)


CORRUPTIONS: dict[str, Callable[[Snapshot], Snapshot]] = {
    "cached_len not aligned": lambda s: _edit(s, ReqState.RUNNING, cached_len=3),
    "pages differ from the tree": lambda s: _edit(
        s, ReqState.RUNNING, pages=tuple(reversed(_view(s, ReqState.RUNNING).pages))
    ),
    "cached prefix unpinned": lambda s: _edit(s, ReqState.RUNNING, lease=None),
    "lease with nothing cached": lambda s: _edit(s, ReqState.LOADING_L2, cached_len=0, pages=(), restore_pages=None),
    "restoring without its source": lambda s: _edit(s, ReqState.LOADING_L2, source=None),
    "restoring without its transfer": lambda s: _edit(s, ReqState.LOADING_L2, transfer=None, restore_pages=None),
    "a source held outside a restore": lambda s: _edit(
        s, ReqState.RUNNING, source=_view(s, ReqState.LOADING_L2).source
    ),
    "restore beyond its prefix": lambda s: _edit(s, ReqState.LOADING_L2, restore_tokens=2, restore_pages=None),
    "layered pages not its prefix": lambda s: _edit(
        s, ReqState.LOADING_L2, restore_pages=tuple(reversed(_view(s, ReqState.LOADING_L2).restore_pages or ()))
    ),
    "a private page held twice": lambda s: _edit(s, ReqState.LOADING_L2, private=_view(s, ReqState.RUNNING).private),
    "a private page lost": lambda s: _edit(s, ReqState.RUNNING, private=()),
    "a released request registered": lambda s: _edit(s, ReqState.RUNNING, state=ReqState.RELEASED),
}
EXPECTED = {
    "cached_len not aligned": "request-cached",
    "pages differ from the tree": "request-cached",
    "cached prefix unpinned": "request-cached",
    "lease with nothing cached": "request-cached",
    "restoring without its source": "request-pins",
    "restoring without its transfer": "request-pins",
    "a source held outside a restore": "request-pins",
    "restore beyond its prefix": "request-restore-pages",
    "layered pages not its prefix": "request-restore-pages",
    "a private page held twice": "request-holdings",
    "a private page lost": "request-holdings",
    "a released request registered": "request-holdings",
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_each_request_invariant_reports_its_corruption(name: str) -> None:
    c, snap = _restoring()
    found = {v.invariant for v in check_requests(CORRUPTIONS[name](snap))}
    assert EXPECTED[name] in found, (name, found)
    c.close()
