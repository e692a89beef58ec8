"""Every report the request invariants can make fires on a snapshot corrupted for it.

The snapshot comes from a real cache built through the facade: one request restoring from
L2 (layered, its H2D in flight) and one running that holds private pages. Each builder
changes one :class:`RequestView` with ``dataclasses.replace``. A report with no builder, or
a code the checker emits that is not registered, fails the meta-tests.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.core.geometry import KVGeometry
from hicache.spec import request_invariants
from hicache.spec.model import Tier
from hicache.spec.request import ReqState
from hicache.spec.request_invariants import REQUEST_REPORTS, check_requests
from hicache.spec.snapshot import RequestView, Snapshot

G = KVGeometry(2, 1, 4, 2, torch.float32)
RUN, LOAD = ReqState.RUNNING, ReqState.LOADING_L2


@dataclass(frozen=True)
class Base:
    """The valid snapshot and its two requests' views (page size 2)::

    running  [1,2,9,9,9]: cached_len 4 (L1 lease), one private page for the tail
    loading  [1,2,3,4,5]: cached_len 2 (L1 lease), H2D of [3,4] in flight, layered
    """

    snap: Snapshot
    running: RequestView
    loading: RequestView


@cache
def base() -> Base:
    c = HiCache(HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu", policy="always"))
    a = c.admit([1, 2, 3, 4])
    pages = c.allocate(a, 2)
    assert pages is not None
    c.insert(a, pages)
    c.release(a)
    c.drain()
    c.core.evict(Tier.L1, 10**6)
    run = c.admit([1, 2, 9, 9, 9])
    more = c.allocate(run, 3)
    assert more is not None
    c.insert(run, more[:2])  # RUNNING, holding one private page
    r = c.admit([1, 2, 3, 4, 5])
    assert r.hit == (2, 4, 0)
    pending = c.start_restore(r, layer_events=())
    assert pending is not None and pending.layered
    snap = c.controller.snapshot()
    c.close()
    assert snap.requests is not None
    views = {v.state: v for v in snap.requests.values()}
    return Base(snap, views[RUN], views[LOAD])


def _edit(b: Base, which: ReqState, **change: object) -> Snapshot:
    view = b.running if which is RUN else b.loading
    assert b.snap.requests is not None
    requests = {**b.snap.requests, view.id: dataclasses.replace(view, **change)}  # type: ignore[arg-type]
    return dataclasses.replace(b.snap, requests=requests)


def _published_l1_page(b: Base) -> int:
    return next(p for n in b.snap.nodes.values() if n.pages[Tier.L1] for p in n.pages[Tier.L1] or ())


BUILDERS: dict[str, Callable[[Base], Snapshot]] = {
    "request-cached.unaligned": lambda b: _edit(b, RUN, cached_len=3),
    "request-cached.page-count": lambda b: _edit(b, RUN, pages=b.running.pages[:1]),
    "request-cached.unpinned": lambda b: _edit(b, RUN, lease=None),
    "request-cached.pages": lambda b: _edit(b, RUN, pages=tuple(reversed(b.running.pages))),
    "request-cached.lease-without-prefix": lambda b: _edit(b, LOAD, cached_len=0, pages=()),
    "request-pins.source": lambda b: _edit(b, LOAD, source=None),
    "request-pins.transfer": lambda b: _edit(b, LOAD, transfer=None, restore_pages=None),
    "request-pins.outside-restore": lambda b: _edit(b, RUN, source=b.loading.source),
    "request-restore-pages.extent": lambda b: _edit(b, LOAD, restore_tokens=2, restore_pages=None),
    "request-restore-pages.layered-without-h2d": lambda b: _edit(b, RUN, restore_pages=b.running.pages),
    "request-restore-pages.layered-pages": lambda b: _edit(
        b, LOAD, restore_pages=tuple(reversed(b.loading.restore_pages or ()))
    ),
    "request-holdings.released-registered": lambda b: _edit(b, RUN, state=ReqState.RELEASED),
    "request-holdings.dead-lease": lambda b: _edit(b, RUN, lease=999),
    "request-holdings.lease-holders": lambda b: _edit(b, LOAD, lease=b.running.lease),
    "request-holdings.not-private": lambda b: _edit(b, RUN, private=(*b.running.private, _published_l1_page(b))),
    "request-holdings.private-owners": lambda b: _edit(b, LOAD, private=b.running.private),
}
"""Per report, a corruption of the base snapshot that must produce it."""

WHERE: dict[str, Callable[[Base], str]] = {
    "request-cached.unaligned": lambda b: f"request #{b.running.id}",
    "request-cached.page-count": lambda b: f"request #{b.running.id}",
    "request-cached.unpinned": lambda b: f"request #{b.running.id}",
    "request-cached.pages": lambda b: f"request #{b.running.id}",
    "request-cached.lease-without-prefix": lambda b: f"request #{b.loading.id}",
    "request-pins.source": lambda b: f"request #{b.loading.id}",
    "request-pins.transfer": lambda b: f"request #{b.loading.id}",
    "request-pins.outside-restore": lambda b: f"request #{b.running.id}",
    "request-restore-pages.extent": lambda b: f"request #{b.loading.id}",
    "request-restore-pages.layered-without-h2d": lambda b: f"request #{b.running.id}",
    "request-restore-pages.layered-pages": lambda b: f"request #{b.loading.id}",
    "request-holdings.released-registered": lambda b: f"request #{b.running.id}",
    "request-holdings.dead-lease": lambda b: "lease #999",
    "request-holdings.lease-holders": lambda b: f"lease #{b.running.lease}",
    "request-holdings.not-private": lambda b: f"L1 page {_published_l1_page(b)}",
    "request-holdings.private-owners": lambda b: f"L1 page {b.running.private[0]}",
}
"""Where each report must point for its corruption above."""


DETAIL: dict[str, str] = {
    "request-cached.unaligned": r"cached_len 3, page size 2",
    "request-cached.page-count": r"cached_len 4 with 1 pages",
    "request-cached.unpinned": r"its cached prefix is not pinned in L1 by its lease",
    "request-cached.pages": r"its page list differs from the tree's L1 pages",
    "request-cached.lease-without-prefix": r"holds an L1 lease with nothing cached",
    "request-pins.source": r"restoring without its L2 source pinned",
    "request-pins.transfer": r"restoring without its H2D in flight",
    "request-pins.outside-restore": r"holds a restore's pin or transfer while running",
    "request-restore-pages.extent": r"restore moves \[\.\., 4\) for 2",
    "request-restore-pages.layered-without-h2d": r"layered pages without an H2D in flight",
    "request-restore-pages.layered-pages": r"layered pages are not exactly its prefix's",
    "request-holdings.released-registered": r"a released request is still registered",
    "request-holdings.dead-lease": r"held but released",
    "request-holdings.lease-holders": r"2 holders",
    "request-holdings.not-private": r"a request's page is not private",
    "request-holdings.private-owners": r"private page held by 2 requests",
}
"""What each report's detail says for its corruption above (a full match)."""


def test_the_base_snapshot_is_valid_and_busy() -> None:
    """The unmodified snapshot reports nothing, and holds what the builders corrupt: a
    layered restore with its source pinned, a running request with a private page."""
    b = base()
    assert check_requests(b.snap) == []
    assert b.loading.source is not None and b.loading.transfer is not None and b.loading.restore_pages
    assert b.running.private and b.running.lease is not None and b.running.cached_len == 4


@pytest.mark.parametrize("code", sorted(BUILDERS))
def test_each_report_fires_on_its_corruption(code: str) -> None:
    """The corrupted snapshot is reported with exactly this code, under its invariant,
    pointing at the corrupted part, with the detail that says what is wrong."""
    b = base()
    found = check_requests(BUILDERS[code](b))
    mine = [v.detail for v in found if (v.code, v.where) == (code, WHERE[code](b))]
    assert mine, found
    assert any(re.fullmatch(DETAIL[code], detail) for detail in mine), mine
    assert all(v.invariant == v.code.partition(".")[0] for v in found)
    assert all(isinstance(v.detail, str) and v.detail for v in found)


def test_every_report_has_a_corruption_test() -> None:
    """A registered report without a builder here fails (and a builder for no report)."""
    assert set(BUILDERS) == set(REQUEST_REPORTS) == set(WHERE) == set(DETAIL)


@pytest.mark.parametrize("end", ["src", "dst"])
def test_a_lease_shared_by_two_transfers_has_two_holders(end: str) -> None:
    """A transfer whose source lease is also the source (or destination) lease of an
    earlier transfer makes that lease held twice."""
    b = base()
    first, second = sorted(b.snap.transfers)
    shared = getattr(b.snap.transfers[first], f"{end}_lease")
    transfers = {**b.snap.transfers, second: dataclasses.replace(b.snap.transfers[second], src_lease=shared)}
    found = check_requests(dataclasses.replace(b.snap, transfers=transfers))
    assert ("request-holdings.lease-holders", f"lease #{shared}", "2 holders") in {
        (v.code, v.where, v.detail) for v in found
    }, found


def test_the_checker_emits_only_registered_codes() -> None:
    """Every violation the module builds goes through ``_v`` with a literal code; every
    such code, and every code emitted on any corruption above, is in REQUEST_REPORTS; every
    registered code is named in the source."""
    named: set[str] = set()
    for fn in ast.parse(inspect.getsource(request_invariants)).body:
        # NOTE: a mutation tool adds mutated copies of each function (``*__mutmut_<n>``) and
        # renames the original (``x_<name>__mutmut_orig``).
        if not isinstance(fn, ast.FunctionDef) or re.search(r"__mutmut_\d+$", fn.name):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            if node.func.id == "Violation":
                assert fn.name in ("_v", "x__v__mutmut_orig"), f"line {node.lineno}: a Violation built without a code"
            elif node.func.id == "_v":
                code = node.args[0]
                assert isinstance(code, ast.Constant) and isinstance(code.value, str), f"line {node.lineno}"
                named.add(code.value)
    assert named == set(REQUEST_REPORTS)
    emitted = {v.code for build in BUILDERS.values() for v in check_requests(build(base()))}
    assert emitted <= set(REQUEST_REPORTS), emitted - set(REQUEST_REPORTS)


@pytest.mark.parametrize("nodes", ["none", "gone", "root"])
def test_a_layered_restore_whose_h2d_has_no_prefix_above_is_reported(nodes: str) -> None:
    """A layered restore whose H2D moves no node, a node no longer in the tree, or the root
    (nothing above it to layer onto) is reported as layered without an H2D, not crashed on."""
    b = base()
    assert b.loading.transfer is not None
    x = b.snap.transfers[b.loading.transfer]
    root = next(nid for nid, n in b.snap.nodes.items() if n.parent is None)
    moved = {"none": (), "gone": (999,), "root": (root,)}[nodes]
    transfers = {**b.snap.transfers, x.id: dataclasses.replace(x, nodes=moved)}
    found = check_requests(dataclasses.replace(b.snap, transfers=transfers))
    assert (
        "request-restore-pages.layered-without-h2d",
        f"request #{b.loading.id}",
        "layered pages without an H2D in flight",
    ) in {(v.code, v.where, v.detail) for v in found}, found
