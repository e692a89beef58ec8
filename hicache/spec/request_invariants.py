"""Invariants tying requests to page runs (DESIGN.md §4b), over a :class:`Snapshot` that
carries ``requests`` (a controller's; a bare core has none and nothing is checked here).

- ``request-cached``: ``cached_len`` is page aligned, equals the request's page list, and that
  prefix is pinned in L1 by the request's lease, page for page the tree's.
- ``request-pins``: a restoring request pins the run it reads in the source tier (covering its
  planned length) and has that restore's transfer in flight; no other state holds either.
- ``request-restore-pages``: a restore moves exactly the request's own prefix (its transfer ends
  at the planned length), and a layered restore's page list is that prefix's L1 pages.
- ``request-holdings``: every lease has exactly one holder (a live request or a transfer), and
  every private L1 page belongs to exactly one live request — so a released request holds none.

Every report has a stable code (:data:`REQUEST_REPORTS`), ``<invariant>.<what>``.
"""

from __future__ import annotations

from collections import Counter

from hicache.spec.invariants import Violation
from hicache.spec.model import Direction, Tier
from hicache.spec.request import ReqState
from hicache.spec.snapshot import NodeView, Snapshot

REQUEST_REPORTS: dict[str, str] = {
    "request-cached.unaligned": "cached_len is not a multiple of page_size",
    "request-cached.page-count": "the page list does not cover exactly [0, cached_len)",
    "request-cached.unpinned": "the cached prefix is not pinned in L1 by the request's lease",
    "request-cached.pages": "the page list differs from the tree's L1 pages of that prefix",
    "request-cached.lease-without-prefix": "an L1 lease held with nothing cached",
    "request-pins.source": "a restoring request does not pin its source run in the source tier",
    "request-pins.transfer": "a restoring request has no transfer of its direction in flight",
    "request-pins.outside-restore": "a restore's pin or transfer held by a request that is not restoring",
    "request-restore-pages.extent": "a restore's transfer does not end at its planned length",
    "request-restore-pages.layered-without-h2d": "layered restore pages without an H2D in flight",
    "request-restore-pages.layered-pages": "layered restore pages are not exactly the prefix's L1 pages",
    "request-holdings.released-registered": "a released request is still registered",
    "request-holdings.dead-lease": "a request or transfer holds a released lease",
    "request-holdings.lease-holders": "a lease without exactly one holder",
    "request-holdings.not-private": "a request's private page is not a private page of the core",
    "request-holdings.private-owners": "a private page not held by exactly one request",
}
"""Every report :func:`check_requests` can make: ``Violation.code`` -> what it means."""

_SOURCE = {ReqState.LOADING_L2: (Tier.L2, Direction.H2D), ReqState.LOADING_L3: (Tier.L3, Direction.S2H)}


def _v(code: str, where: str, detail: str) -> Violation:
    return Violation(code.partition(".")[0], where, detail, code)


def _path(s: Snapshot, nid: int) -> list[NodeView]:
    out: list[NodeView] = []
    n = s.nodes.get(nid)
    while n is not None and n.parent is not None:
        out.append(n)
        n = s.nodes.get(n.parent)
    out.reverse()
    return out


def _l1_pages(s: Snapshot, nid: int) -> list[int] | None:
    out: list[int] = []
    for n in _path(s, nid):
        pages = n.pages[Tier.L1]
        if pages is None:
            return None
        out.extend(pages)
    return out


def check_requests(s: Snapshot) -> list[Violation]:
    """Every violation of the request invariants (module docstring); empty when they hold."""
    if s.requests is None:
        return []
    out: list[Violation] = []
    ps = s.page_size
    holders: Counter[int] = Counter()
    for t in s.transfers.values():
        holders[t.src_lease] += 1
        if t.dst_lease is not None:
            holders[t.dst_lease] += 1
    owners: Counter[int] = Counter()
    for r in s.requests.values():
        where = f"request #{r.id}"
        if r.state is ReqState.RELEASED:
            out.append(_v("request-holdings.released-registered", where, "a released request is still registered"))
        # request-cached
        if r.cached_len % ps:
            out.append(_v("request-cached.unaligned", where, f"cached_len {r.cached_len}, page size {ps}"))
        elif len(r.pages) * ps != r.cached_len:
            out.append(_v("request-cached.page-count", where, f"cached_len {r.cached_len} with {len(r.pages)} pages"))
        lease = None if r.lease is None else s.leases.get(r.lease)
        if r.cached_len:
            if lease is None or not lease.alive or lease.tier is not Tier.L1 or lease.length != r.cached_len:
                out.append(_v("request-cached.unpinned", where, "its cached prefix is not pinned in L1 by its lease"))
            else:
                along = _l1_pages(s, lease.node)
                if along is None or tuple(along[: r.cached_len // ps]) != r.pages:
                    out.append(_v("request-cached.pages", where, "its page list differs from the tree's L1 pages"))
        elif r.lease is not None:
            out.append(_v("request-cached.lease-without-prefix", where, "holds an L1 lease with nothing cached"))
        # request-pins
        x = None if r.transfer is None else s.transfers.get(r.transfer)
        if r.state in _SOURCE:
            tier, direction = _SOURCE[r.state]
            src = None if r.source is None else s.leases.get(r.source)
            if src is None or not src.alive or src.tier is not tier or src.length < r.restore_tokens:
                out.append(_v("request-pins.source", where, f"restoring without its {tier.name} source pinned"))
            if x is None or x.direction is not direction:
                out.append(_v("request-pins.transfer", where, f"restoring without its {direction.name} in flight"))
        elif r.source is not None or r.transfer is not None:
            out.append(
                _v("request-pins.outside-restore", where, f"holds a restore's pin or transfer while {r.state.value}")
            )
        # request-restore-pages
        if x is not None and x.nodes:
            bottom = sum(len(n.key) for n in _path(s, x.nodes[-1]))
            if bottom != r.restore_tokens:
                detail = f"restore moves [.., {bottom}) for {r.restore_tokens}"
                out.append(_v("request-restore-pages.extent", where, detail))
        if r.restore_pages is not None:
            top = None if x is None or not x.nodes or x.nodes[0] not in s.nodes else s.nodes[x.nodes[0]].parent
            above = None if top is None else _l1_pages(s, top)
            if r.state is not ReqState.LOADING_L2 or x is None or above is None:
                out.append(
                    _v("request-restore-pages.layered-without-h2d", where, "layered pages without an H2D in flight")
                )
            elif (*above, *x.dst) != r.restore_pages or len(r.restore_pages) * ps != r.restore_tokens:
                out.append(
                    _v("request-restore-pages.layered-pages", where, "layered pages are not exactly its prefix's")
                )
        for held in (r.lease, r.source):
            if held is not None:
                holders[held] += 1
        owners.update(r.private)
    # request-holdings
    for lid in sorted(set(s.leases) | set(holders)):
        if lid not in s.leases:
            out.append(_v("request-holdings.dead-lease", f"lease #{lid}", "held but released"))
        elif holders[lid] != 1:
            out.append(_v("request-holdings.lease-holders", f"lease #{lid}", f"{holders[lid]} holders"))
    private = set(s.private)
    for p in sorted(private | set(owners)):
        if p not in private:
            out.append(_v("request-holdings.not-private", f"L1 page {p}", "a request's page is not private"))
        elif owners[p] != 1:
            out.append(
                _v("request-holdings.private-owners", f"L1 page {p}", f"private page held by {owners[p]} requests")
            )
    return out
