"""A hypothesis state machine for the engine-facing :class:`~hicache.HiCache`.

Each run draws a write policy and tier sizes (small L1s, so restores and inserts make room;
L3 sometimes absent), then requests arrive with prompts around page boundaries, restore
(asynchronously, layered or blocking), allocate, prefill, insert, allocate decode pages and
are released in every request state; write-through runs underneath; eviction hits every tier.
Calls the request model refuses must raise MisuseError and change nothing.

Transfers go through :class:`ScheduledMover`, which wraps the real CPU backends: a transfer is
queued with its destination poisoned (NaN), and the machine completes it (the real copy runs),
fails it, or leaves it in flight, in any order; a queued one can be withdrawn (``cancel``).
With ``scheduled = False`` the real backends run on their own (L3 on its I/O threads) and the
machine injects faults instead.

Each L1 page's bytes are a content tag of the token prefix it holds. After every step:
``check_integrity()`` (page runs and requests); every live request's usable L1 pages hold its
prefix's tags (nothing readable before it is published); every page published in L1 or L2
holds the tag of its prefix. ``coverage`` / ``request_coverage`` accumulate the page-run and
request transitions taken over all runs (the test asserts both are complete).

An embedder fuzzes their own L1 pool and L1 <-> L2 mover with :func:`machines_over`
(docs/TESTING.md; ``docs/examples/fuzz_my_loop.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, cast

import numpy as np
import pytest
import torch
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.backends.faults import FaultKind
from hicache.backends.pools import HostPool
from hicache.backends.stores import PageStore
from hicache.backends.ticket import Timings
from hicache.core.controller import PendingRestore, Request
from hicache.core.geometry import KVGeometry
from hicache.core.keys import page_keys
from hicache.core.node import Node
from hicache.core.protocols import DeviceMover
from hicache.errors import ConfigError, HiCacheError, MisuseError
from hicache.facade import MOVER_MEMBERS, HiCache, HiCacheConfig
from hicache.spec.model import TABLE, Event, RunState, Tier
from hicache.spec.request import REQUEST_TABLE, ReqEvent, ReqState
from hicache.testing.fake_backend import page_tag
from hicache.testing.memory_store import MemoryStore

G = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype=torch.float32)
_PAGE_ELEMENTS = 2 * G.num_layers * G.page_size * G.num_kv_heads * G.head_dim
SIZES = [(8, 6, 10), (5, 6, 8), (4, 4, 0), (6, 3, 6)]  # (L1, L2, L3) pages
POLICIES = ["write_through", "write_through_selective", "write_back"]

# How to bring the prompt P (two pages) into each page-run state through the cache's calls,
# with write-through and scheduled transfers (FacadeMachine._op says what each step does).
RECIPES: dict[str, list[str]] = {
    "none": [],
    "L1": ["insert", "fail_copy"],
    "D2H_PENDING": ["insert"],
    "L1_L2": ["insert", "land_copy", "fail_io"],
    "H2S_PENDING": ["insert", "land_copy"],
    "L1_L2_L3": ["insert", "land_copy", "land_io"],
    "L2": ["insert", "land_copy", "fail_io", "abort_all", "drop_L1"],
    "H2D_PENDING": ["insert", "land_copy", "fail_io", "abort_all", "drop_L1", "restore"],
    "L3": ["insert", "settle", "abort_all", "drop_L1", "drop_L2"],
    "S2H_PENDING": ["insert", "settle", "abort_all", "drop_L1", "drop_L2", "restore"],
    "L2_L3": ["insert", "settle", "abort_all", "drop_L1"],
    "L2_L3__H2D": ["insert", "settle", "abort_all", "drop_L1", "restore"],
    "L2__H2S": ["insert", "land_copy", "abort_all", "drop_L1"],
    "L2__H2S_H2D": ["insert", "land_copy", "abort_all", "drop_L1", "restore"],
    "L1_L3": ["insert", "settle", "drop_L2"],
    "L1_L3__D2H": ["insert", "settle", "drop_L2", "extend"],
    "L1_L3__S2H": ["insert", "extend", "settle", "abort_all", "drop_L2", "drop_L1_leaf", "restore_ext"],
    # an extension's H2S deferred behind P's, started once P's lands: on E in L2 / H2D_PENDING
    "E:L2+H2S": ["insert", "land_copy", "extend", "land_copy", "abort_all", "drop_L1", "land_io"],
    "E:H2D+H2S": ["insert", "land_copy", "extend", "land_copy", "abort_all", "drop_L1", "restore_ext", "land_io"],
}
# The same for a shared store (SharedStoreMachine): runs discovered in each state a store copy
# may join, discovered runs read back, and runs a read finds lost. P+E is P extended by one page.
SHARED_RECIPES: dict[str, list[str]] = {
    "D:REMOTE": ["gain", "admit"],
    "D:L1": ["insert", "fail_copy", "gain_ext", "admit_ext"],
    "D:D2H_PENDING": ["insert", "gain_ext", "admit_ext"],
    "D:L1_L2": ["insert", "land_copy", "fail_io", "gain_ext", "admit_ext"],
    "D:L2": ["insert", "land_copy", "fail_io", "abort_all", "drop_L1", "gain_ext", "admit_ext"],
    "D:H2D_PENDING": ["insert", "land_copy", "fail_io", "abort_all", "drop_L1", "restore", "gain_ext", "admit_ext"],
    # runs discovered, then read back: the pages another instance wrote land in L2 and L1
    "R:REMOTE": ["gain", "restore", "land_io", "land_copy"],
    "R:L2+E": [
        "insert", "land_copy", "fail_io", "abort_all", "drop_L1", "gain_ext", "restore_ext", "land_io", "land_copy",
    ],
    "X:L3": ["insert", "settle", "abort_all", "drop_L1", "drop_L2", "lose_store", "restore", "land_io"],
    "X:L1_L3": [
        "insert", "extend", "settle", "abort_all", "drop_L2", "drop_L1_leaf", "lose_store", "restore_ext", "land_io",
    ],
}  # fmt: skip
FOLLOW_UPS = [
    "none", "land_copy", "fail_copy", "land_io", "fail_io", "abort_all", "recompute",
    "drop_L1", "drop_L2", "drop_L3", "restore", "restore_ext", "extend", "abort_all+drop_L1",
    "begin_copy", "begin_io+abort_all+drop_L1",
    # the request calls in each state that allows them (a restore from L2 in flight, then done)
    "restore+alloc+land_copy+alloc+alloc+insert_last+alloc", "restore+land_copy+insert_last",
    "restore+land_copy+alloc+release_last",
]  # fmt: skip


def _note(message: str) -> None:
    """hypothesis' note() inside a test; nothing outside one (a recipe sweep)."""
    with contextlib.suppress(InvalidArgument):
        note(message)


def tag_value(prefix: Sequence[int]) -> float:
    """A float32-exact content value for the page ending ``prefix`` (its first element's)."""
    return float(page_tag(prefix) % (1 << 17) * _SPAN + 1)


# A page's elements each hold its tag plus their own position in the page, so a copy that
# moves the right pages but the wrong layer, K for V, or tokens within a page is caught too
# (with one value per page only the page was checked). float32-exact: < 2**24.
_SPAN = 64


def wrong_content(got: torch.Tensor, want: torch.Tensor) -> str:
    """What a page that fails the content check holds instead of ``want`` (its
    :func:`page_content`): never written, another page, K/V or layers or tokens
    rearranged, or which elements differ."""
    n, nan = got.numel(), int(torch.isnan(got).sum())
    if nan == n:
        return "never written (the poison a copy not landed leaves)"
    if nan:
        return f"{nan} of {n} elements never written"
    bases = torch.unique(got - _OFFSETS)
    if bases.numel() == 1:
        return f"another page's content (tag {bases.item()!r}, want {want.reshape(-1)[0].item()!r})"
    for what, moved in (
        ("K and V swapped", want.flip(0)),
        ("layers shifted by one", want.roll(1, dims=1)),  # G's 2 layers: either way
        ("tokens of the page reversed", want.flip(2)),
    ):
        if torch.equal(got, moved):
            return what
    diff = (got != want).nonzero()
    at = tuple(int(i) for i in diff[0])
    return (
        f"{diff.shape[0]} of {n} elements differ, the first at [kv, layer, token, head, dim] "
        f"{list(at)}: {got[at].item()!r}, want {want[at].item()!r}"
    )


def page_content(prefix: Sequence[int]) -> torch.Tensor:
    """The content of the page ending ``prefix``, shaped as one page of the L1 pool
    (``[2, layers, page_size, kv_heads, head_dim]``, also an L2 page's layout): its
    :func:`tag_value` plus each element's index."""
    return _OFFSETS + tag_value(prefix)


_OFFSETS = torch.arange(_PAGE_ELEMENTS, dtype=torch.float32).view(
    2, G.num_layers, G.page_size, G.num_kv_heads, G.head_dim
)  # each element's position in its page, what page_content adds to the tag


@dataclass(eq=False)
class ScheduledTicket:
    nbytes: int
    ok: bool | None = None
    error: str | None = None
    extents: int = 0
    timings: Timings = field(default_factory=Timings)
    run: Callable[[], bool] | None = None  # performs the real copy; returns True on success
    mover: ScheduledMover | None = None
    started: bool = False  # the copy began: it can no longer be withdrawn
    lost: bool = False
    expired: bool = False
    settled: bool = True

    def poll(self) -> bool:
        return self.ok is not None

    def wait(self) -> bool:
        if self.ok is None:
            if self.mover is not None and self in self.mover.queue:
                self.mover.queue.remove(self)
            assert self.run is not None
            self.ok = bool(self.run())
        return self.ok

    def cancel(self) -> bool:
        if self.ok is not None or self.started or self.mover is None or self not in self.mover.queue:
            return False
        self.mover.queue.remove(self)
        self.ok, self.error = False, "cancelled"
        return True


class _CheckedTicket:
    """A ticket of the embedder's mover as it is, but a ``cancel`` that says it withdrew
    the copy is held to it (:class:`CheckedMover`)."""

    def __init__(self, real: Any, withdrawn: Callable[[Any], None]) -> None:
        self._real, self._withdrawn = real, withdrawn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def cancel(self) -> bool:
        withdrawn = bool(self._real.cancel())
        if withdrawn:
            self._withdrawn(self._real)
        return withdrawn


class CheckedMover:
    """The embedder's mover under the real machine, as it is, except that a ticket's
    ``cancel`` that returns True is checked: its destination pages (still the transfer's)
    are filled with NaN and the ticket waited for; a page that then holds anything else
    means the withdrawn copy landed, where the cache has already given the pages back. The
    pages stay watched until something else writes them (a copy into them, the machine's
    prefill: :meth:`written`), so a copy that lands later still shows (a ticket whose
    ``wait`` returns at once once cancelled, the copy running on regardless: :meth:`recheck`,
    at every invariant check). Either is recorded in ``landed`` (the
    controller takes an exception from ``cancel`` as "not withdrawn") and fails the next
    invariant check."""

    def __init__(self, real: Any, l1: torch.Tensor, l2: torch.Tensor) -> None:
        self.real = real
        self.views = {"D2H": l2, "H2D": l1.transpose(0, 2)}  # NOTE: page-major views
        self.landed: list[str] = []
        self.watched: dict[tuple[str, int], None] = {}  # (direction, page) filled with NaN at a cancel, unwritten since

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def written(self, direction: str, pages: Iterable[int]) -> None:
        """``pages`` (of ``direction``'s destination pool) get a writer now (a copy into them,
        the machine's prefill): their content is no longer the withdrawn copy's to keep."""
        for p in pages:
            self.watched.pop((direction, int(p)), None)

    def recheck(self) -> None:
        """A watched page that no longer holds NaN: a withdrawn copy landed after its wait."""
        for direction, page in list(self.watched):
            if not bool(torch.isnan(self.views[direction][page]).all()):
                del self.watched[(direction, page)]
                self.landed.append(
                    f"the mover's cancel said it withdrew a {direction} copy, which landed after the ticket's wait "
                    f"returned, in its destination page {page} (given back to the cache at the cancel, unwritten since)"
                )

    def _checked(self, direction: str, dst: Sequence[int], ticket: Any) -> _CheckedTicket:
        view, pages = self.views[direction], list(dst)

        def withdrawn(real: Any) -> None:
            view[pages] = float("nan")
            with contextlib.suppress(Exception):  # NOTE: a ticket that raises failed; the cache said so
                real.wait()
            kept = [p for p in pages if not bool(torch.isnan(view[p]).all())]
            if kept:
                self.landed.append(
                    f"the mover's cancel said it withdrew a {direction} copy, which then landed in its "
                    f"destination pages {kept} (given back to the cache at the cancel)"
                )
            self.watched.update(dict.fromkeys((direction, p) for p in pages if p not in kept))

        return _CheckedTicket(ticket, withdrawn)

    def d2h(self, src: Sequence[int], dst: Sequence[int]) -> Any:
        self.written("D2H", dst)
        return self._checked("D2H", dst, self.real.d2h(src, dst))

    def h2d(self, src: Sequence[int], dst: Sequence[int], layer_events: Sequence[Any] | None = None) -> Any:
        self.written("H2D", dst)
        return self._checked("H2D", dst, self.real.h2d(src, dst, layer_events=layer_events))


class _CheckedStorage:
    """The real machine's L3 mover as it is; its reads (S2H, into L2 pages) are writers of
    the pages :class:`CheckedMover` watches."""

    def __init__(self, real: Any, checked: CheckedMover) -> None:
        self.real, self.checked = real, checked

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def read(self, src: Any, dst: Sequence[int], *args: Any, **kwargs: Any) -> Any:
        self.checked.written("D2H", dst)
        return self.real.read(src, dst, *args, **kwargs)


class ScheduledMover:
    """Queues copies on the real backends until :meth:`finish` says complete or fail."""

    def __init__(self, real: Any, poison: dict[str, Callable[[Sequence[int]], None]]) -> None:
        self.real = real
        self.poison = poison  # method name -> poisons that call's destination pages
        self.queue: list[ScheduledTicket] = []

    def _submit(
        self,
        name: str,
        a: Sequence[int],
        b: Sequence[int],
        keys: Sequence[bytes] | None = None,
        above: Sequence[bytes] = (),
    ) -> ScheduledTicket:
        self.poison[name](b)  # destinations hold garbage until completion
        ticket = ScheduledTicket(len(a) * G.bytes_per_page)

        def run() -> bool:
            call = getattr(self.real, name)
            try:
                real = call(a, b) if keys is None else call(a, b, keys, above=above)
            except HiCacheError:
                raise
            except Exception as exc:
                # NOTE: the real call is made here, at completion; a mover that raises on
                # issue fails its transfer, nothing else, as it does under the controller.
                ticket.error = f"could not be issued: {exc!r}"
                return False
            ok = bool(real.wait())
            ticket.lost = name in ("write", "read") and bool(real.lost)
            return ok

        ticket.run = run
        ticket.mover = self
        self.queue.append(ticket)
        return ticket

    def d2h(self, src: Sequence[int], dst: Sequence[int]) -> ScheduledTicket:
        return self._submit("d2h", src, dst)

    def h2d(self, src: Sequence[int], dst: Sequence[int], layer_events: Sequence[Any] | None = None) -> ScheduledTicket:
        return self._submit("h2d", src, dst)  # CPU: no events to record

    def write(
        self,
        host_pages: Sequence[int],
        slots: Sequence[int],
        keys: Sequence[bytes] | None = None,
        *,
        above: Sequence[bytes] = (),
    ) -> ScheduledTicket:
        return self._submit("write", host_pages, slots, keys, above)

    def read(
        self,
        slots: Sequence[int],
        host_pages: Sequence[int],
        keys: Sequence[bytes] | None = None,
        *,
        above: Sequence[bytes] = (),
    ) -> ScheduledTicket:
        return self._submit("read", slots, host_pages, keys, above)

    def exists(self, keys: Sequence[bytes]) -> int:
        return int(self.real.exists(keys))

    @property
    def keyed(self) -> bool:
        return bool(self.real.keyed)

    @property
    def shared(self) -> bool:
        return bool(self.real.shared)

    @property
    def available(self) -> bool:
        return bool(self.real.available)

    @property
    def layered(self) -> bool:
        return False

    def layer_groups(self) -> list[tuple[int, int]]:
        return [(0, G.num_layers)]

    def finish(self, i: int, ok: bool) -> None:
        ticket = self.queue[i % len(self.queue)]
        if ok:
            ticket.wait()
        else:
            self.queue.remove(ticket)
            ticket.ok, ticket.error = False, "scheduled failure"

    def close(self, *, wait: bool = True) -> None:
        self.real.close(wait=wait)

    @property
    def persistent(self) -> bool:
        return bool(self.real.persistent)

    def status(self) -> dict[str, Any]:
        return dict(self.real.status(), scheduled=len(self.queue))


class FacadeMachine(RuleBasedStateMachine):
    scheduled: ClassVar[bool] = True
    shared: ClassVar[bool] = False  # L3 an in-memory shared store that others write and evict
    coverage: ClassVar[Counter[tuple[RunState, Event]]] = Counter()
    request_coverage: ClassVar[Counter[tuple[ReqState, ReqEvent]]] = Counter()
    # the L3 stores runs were built over: "persistent" (outlives the cache) or "transient"
    stores_seen: ClassVar[Counter[str]] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.cache: HiCache | None = None
        self.movers: list[ScheduledMover] = []
        self.requests: list[Request] = []
        self.prompts: list[tuple[int, ...]] = []
        self.store: Any = None  # the L3 store made by make_store (None: the cache's own)
        self.checked: CheckedMover | None = None  # the mover, under the real machine
        self.started: list[PendingRestore] = []  # restores start_restore returned (kept: ids stay unique)
        self.reported: set[int] = set()  # ids of those a poll returned

    @property
    def c(self) -> HiCache:
        assert self.cache is not None
        return self.cache

    # -- what an embedder swaps in -------------------------------------------------------------

    def make_l1(self, geometry: KVGeometry, pages: int) -> torch.Tensor | None:
        """The L1 KV pool the cache is built over (``[2, layer, page, token, kv_head,
        head_dim]`` on the CPU); None lets the cache allocate one."""
        return None

    def make_store(self, host: HostPool) -> PageStore:
        """The L3 store the cache is built over, given its L2 pool. Used by the shared
        machine (a :class:`MemoryStore`), and by the others only where overridden
        (:func:`machines_over`'s ``store``; else the cache's own ``file`` store). A store for
        the shared machine must also take ``add(key, page_bytes)`` and ``drop(key)``: the other
        instances that write and evict behind the cache's back."""
        return MemoryStore(host)

    def make_device(self, cache: HiCache) -> DeviceMover:
        """The L1 <-> L2 mover over ``cache.l1`` and ``cache.l2`` (the scheduled machines
        wrap it); by default the cache's own :class:`~hicache.backends.transfer.TransferEngine`."""
        return cache.device

    # -- helpers -----------------------------------------------------------------------------

    def _build(self, sizes: tuple[int, int, int], policy: str) -> None:
        l1, l2, l3 = sizes

        def store(host: HostPool) -> PageStore:
            made = self.store = self.make_store(host)
            return made

        own = self.shared or type(self).make_store is not FacadeMachine.make_store

        config = HiCacheConfig(
            G,
            l1_pages=l1,
            l2_pages=l2,
            l3_pages=l3,
            policy="always",
            write_policy=policy,
            selective_hits=1,
            device="cpu",
            tracing=True,
            transfer_backend="torch",
            model_id="facade-machine",
        )
        c = HiCache(config, self.make_l1(G, l1), store=store if own and l3 else None)
        try:
            mover = self._check_backends(c)
        except BaseException:
            c.close()
            raise
        self.cache = c
        if c.storage is not None:
            type(self).stores_seen["persistent" if c.storage.persistent else "transient"] += 1
        _note(f"sizes {sizes}, {policy}")
        if not self.scheduled:
            self.checked = CheckedMover(mover, c.l1.buffer, c.l2.page_buffer)
            c.controller.device = self.checked
            if c.controller.storage is not None:
                c.controller.storage = cast(Any, _CheckedStorage(c.controller.storage, self.checked))
            return
        host, dev = c.l2.page_buffer, c.l1.buffer.transpose(0, 2)  # NOTE: poison only: page order

        def poison(view: torch.Tensor) -> Callable[[Sequence[int]], None]:
            def run(pages: Sequence[int]) -> None:
                view[list(pages)] = float("nan")

            return run

        device = ScheduledMover(mover, {"d2h": poison(host), "h2d": poison(dev)})
        self.movers = [device]
        c.controller.device = device
        if c.storage is not None:
            storage = ScheduledMover(c.storage, {"write": lambda pages: None, "read": poison(host)})
            c.controller.storage = storage
            self.movers.append(storage)

    def _check_backends(self, c: HiCache) -> DeviceMover:
        """The mover from :meth:`make_device`, and the store, checked to be what the machine
        calls (ConfigError naming what lacks, before any step runs)."""
        mover = self.make_device(c)
        missing = [m for m in MOVER_MEMBERS if not hasattr(mover, m)]
        if missing:
            raise ConfigError(
                f"make_device(cache) must return a DeviceMover; {type(mover).__name__} lacks {', '.join(missing)}"
            )
        made = self.store
        if (
            self.shared
            and made is not None
            and not (getattr(made, "keyed", False) and hasattr(made, "add") and hasattr(made, "drop"))
        ):
            raise ConfigError(
                f"the shared machine needs a keyed store with add(key, page_bytes) and drop(key); "
                f"{type(made).__name__} is not one (leave the shared machine out for it)"
            )
        return mover

    def _fill(self, tokens: tuple[int, ...], first_page: int, pages: Sequence[int]) -> None:
        ps = G.page_size
        if self.checked is not None:
            self.checked.written("H2D", pages)
        for i, p in enumerate(pages):
            end = min(len(tokens), (first_page + i + 1) * ps)
            self.c.l1.buffer[:, :, p] = page_content(tokens[:end])

    def _poll(self) -> list[PendingRestore]:
        """``poll()``, checking its contract: it returns only restores that ``start_restore``
        gave and that finished, each once; and after it, every such restore of a request still
        live that has finished was returned (an engine loop hands a restore over only then)."""
        finished = self.c.poll()
        started = {id(r) for r in self.started}
        for r in finished:
            assert id(r) in started, f"poll returned a restore no start_restore gave (request #{r.request.id})"
            assert r.finished, f"poll returned restore of request #{r.request.id} before it finished ({r.stage})"
            assert id(r) not in self.reported, f"poll returned the restore of request #{r.request.id} twice"
            self.reported.add(id(r))
        for r in self.started:
            if r.finished and not r.request.released:
                assert id(r) in self.reported, (
                    f"the restore of request #{r.request.id} ended ({r.stage}) and no poll returned it"
                )
        return finished

    def _settle(self) -> None:
        """Complete everything queued (scheduled) or wait for it (real backends)."""
        for _ in range(100):
            for m in self.movers:
                while m.queue:
                    m.finish(0, True)
            self._poll()
            st_ = self.c.status()
            if not st_.pending_backups and not st_.pending_restores:
                return
            if not self.movers:
                time.sleep(0.002)

    def _never_fits(self, req: Request, n: int) -> bool:
        """More L1 pages than the pool holds beside the request's own: allocate refuses."""
        return n + len(req.pages) + len(req.private) > self.c.controller.core.l1.capacity

    def _refused(self, req: Request, call: Callable[[], object]) -> None:
        """A call the request model refuses raises MisuseError and changes nothing."""

        def status() -> dict[str, object]:
            out = self.c.status().to_dict()
            if not self.scheduled:  # NOTE: real I/O threads move the store's counters meanwhile
                out.pop("storage", None)
            return out

        before = (req.state, req.cached_len, list(req.pages), list(req.private), status())
        with pytest.raises(MisuseError):
            call()
        after = (req.state, req.cached_len, list(req.pages), list(req.private), status())
        assert before == after, [(k, v, after[-1][k]) for k, v in before[-1].items() if after[-1][k] != v]

    # -- rules -------------------------------------------------------------------------------

    @initialize(
        sizes=st.sampled_from(SIZES),
        policy=st.sampled_from(POLICIES),
        seeds=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=7), min_size=1, max_size=3),
        drop=st.sampled_from([(), (Tier.L1,), (Tier.L1, Tier.L2), (Tier.L2,), (Tier.L1, Tier.L3)]),
        recipe=st.one_of(st.just("none"), st.sampled_from(sorted(RECIPES) + sorted(SHARED_RECIPES))),
        then=st.sampled_from(FOLLOW_UPS),
    )
    def seed(
        self,
        sizes: tuple[int, int, int],
        policy: str,
        seeds: list[list[int]],
        drop: tuple[Tier, ...],
        recipe: str,
        then: str,
    ) -> None:
        """Either prompts inserted, backed up, then tiers drained (restores ahead), or (with
        scheduled transfers) a prompt brought into a drawn page-run state through the cache's
        own calls (:data:`RECIPES`, write-through, all three tiers), then drawn operations."""
        if recipe in SHARED_RECIPES and not self.shared:
            recipe = "none"
        if self.scheduled and recipe != "none":
            self._build((8, 6, 10), "write_through")
            _note(f"recipe {recipe} then {then}")
            for op in [*{**RECIPES, **SHARED_RECIPES}[recipe], *then.split("+")]:
                self._op(op)
            return
        self._build(sizes, policy)
        for tokens in seeds:
            self.admit(tokens)
            self.prefill_and_insert(len(self.requests) - 1)
            self._settle()
            self.release(len(self.requests) - 1)
        for tier in drop:
            self.c.core.evict(tier, 10**6)

    def _op(self, op: str) -> None:
        """One step of a recipe, on the prompt ``P`` = (0, 0, 1, 1) and its extension ``P+E``."""
        p, pe = [0, 0, 1, 1], [0, 0, 1, 1, 2, 2]
        if op in ("insert", "extend", "recompute"):
            self.admit(pe if op == "extend" else p)
            self.prefill_and_insert(len(self.requests) - 1)
        elif op in ("restore", "restore_ext"):
            self.admit(pe if op == "restore_ext" else p)
            self.restore(len(self.requests) - 1, blocking=False, layered=False)
        elif op in ("land_copy", "fail_copy", "land_io", "fail_io"):
            mover = self.movers[0 if op.endswith("copy") else 1]
            while mover.queue:
                mover.finish(0, op.startswith("land"))
            self._poll()
        elif op in ("begin_copy", "begin_io"):
            for ticket in self.movers[0 if op.endswith("copy") else 1].queue:
                ticket.started = True
        elif op == "settle":
            self._settle()
        elif op.startswith("drop_"):
            tier = Tier[op.removeprefix("drop_").removesuffix("_leaf")]
            self.c.core.evict(tier, 1 if op.endswith("_leaf") else 10**6)
        elif op in ("gain", "gain_ext"):
            self._gain(tuple(pe if op == "gain_ext" else p))
        elif op in ("admit", "admit_ext"):
            self.admit(pe if op == "admit_ext" else p)
        elif op == "lose_store":
            for i in range(len(pe) // G.page_size):
                self._lose(tuple(pe), i)
        elif op == "alloc":
            self.allocate(len(self.requests) - 1, 1)
        elif op == "insert_last":
            self.prefill_and_insert(len(self.requests) - 1)
        elif op == "release_last":
            self.release(len(self.requests) - 1)
        elif op == "abort_all":
            while self.requests:
                self.release(0)
        elif op != "none":
            raise ValueError(f"unknown recipe step {op!r}")

    def _has_prompts(self) -> bool:
        return bool(self.prompts)

    @precondition(_has_prompts)
    @rule(
        i=st.integers(0, 7),
        extra=st.sampled_from([(), (1,), (2, 0)]),
        now=st.sampled_from(["restore", "layered", "later"]),
    )
    def readmit(self, i: int, extra: tuple[int, ...], now: str) -> None:
        """A known prompt comes back, maybe extended, and (as the engine does) restores at
        once — or later, or never (a split, an extension, a restore's room-making)."""
        self.admit(list(self.prompts[i % len(self.prompts)]) + list(extra))
        if now != "later":
            self.restore(len(self.requests) - 1, blocking=False, layered=now == "layered")

    @precondition(_has_prompts)
    @rule(i=st.integers(0, 7), layered=st.booleans())
    def restore_known(self, i: int, layered: bool) -> None:
        """A known prompt comes back and restores at once (the engine's admission)."""
        self.readmit(i, (), "layered" if layered else "restore")

    @precondition(_has_prompts)
    @rule(i=st.integers(0, 7), via=st.sampled_from([Tier.L2, Tier.L3]), layered=st.booleans(), fresh=st.booleans())
    def round_trip(self, i: int, via: Tier, layered: bool, fresh: bool) -> None:
        """A known prompt's pages go down to ``via`` and come back: everything in flight
        lands, L1 (and for L3, L2) is emptied of what is unpinned, the prompt is admitted
        and restored, and its copies land, so the restored pages are checked. ``fresh``:
        every tier is emptied first and the prompt computed again, so its backups take
        pages and slots others held. Drawn step by step this takes half a dozen rules in
        order, which random runs seldom draw: a store that serves a reused slot's old bytes
        is caught only by a restore from L3 that lands."""
        prompt = self.prompts[i % len(self.prompts)]
        self._settle()
        if fresh:
            for tier in Tier:
                self.c.core.evict(tier, 10**6)
        whole = len(prompt) - len(prompt) % G.page_size
        if whole and max(self.c.core.tree.match_prefixes(prompt).lengths) < whole:
            self.admit(list(prompt))  # computed first where nobody has yet
            self.prefill_and_insert(len(self.requests) - 1)
            self._settle()
            self.release(len(self.requests) - 1)
        self.c.core.evict(Tier.L1, 10**6)
        if via is Tier.L3:
            self._settle()  # the L3 backups, started as the L1 copies went
            self.c.core.evict(Tier.L2, 10**6)
        self.readmit(i, (), "layered" if layered else "restore")
        self._settle()

    @precondition(_has_prompts)
    @rule(i=st.integers(0, 7), extra=st.sampled_from([(), (0,), (1, 2)]))
    def recompute(self, i: int, extra: tuple[int, ...]) -> None:
        """A known prompt comes back and is prefilled without restoring: its pages are
        inserted into runs that live only in L2/L3 (or are being restored by another)."""
        self.admit(list(self.prompts[i % len(self.prompts)]) + list(extra))
        self.prefill_and_insert(len(self.requests) - 1)

    def _keys(self, tokens: tuple[int, ...]) -> list[bytes]:
        seed = self.c.controller.key_seed
        assert seed is not None
        return page_keys(seed, tokens[: len(tokens) - len(tokens) % G.page_size], G.page_size)

    def _gain(self, tokens: tuple[int, ...]) -> None:
        """Another instance computed ``tokens`` and stored its pages (their content tags)."""
        assert self.store is not None
        for j, key in enumerate(self._keys(tokens)):
            content = page_content(tokens[: (j + 1) * G.page_size])
            self.store.add(key, content.numpy().reshape(-1).view(np.uint8))
        _note(f"store gains {tokens}")

    def _lose(self, tokens: tuple[int, ...], page: int) -> None:
        assert self.store is not None
        keys = self._keys(tokens)
        if keys:
            self.store.drop(keys[page % len(keys)])
            _note(f"store loses page {page % len(keys)} of {tokens}")

    def _shares(self) -> bool:
        return self.shared and self.store is not None and bool(self.prompts)

    @precondition(_shares)
    @rule(i=st.integers(0, 7), extra=st.sampled_from([(), (1, 1), (2, 0, 1, 2)]))
    def store_gains(self, i: int, extra: tuple[int, ...]) -> None:
        """Another instance stores a known prompt, maybe extended (discovery ahead)."""
        self._gain(self.prompts[i % len(self.prompts)] + extra)

    @precondition(_shares)
    @rule(i=st.integers(0, 7), page=st.integers(0, 4))
    def store_loses(self, i: int, page: int) -> None:
        """The store evicts a page another instance wrote (a read of it will find it gone)."""
        self._lose(self.prompts[i % len(self.prompts)], page)

    @rule(tier=st.sampled_from(Tier))
    def pressure(self, tier: Tier) -> None:
        """Everything unpinned in ``tier`` goes (another tenant's load)."""
        self.c.core.evict(tier, 10**6)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def admit(self, tokens: list[int]) -> None:
        req = self.c.admit(tokens)
        self.requests.append(req)
        if req.tokens not in self.prompts:
            self.prompts.append(req.tokens)
        _note(f"admit #{req.id} {req.tokens}: hit {req.hit}")

    def _has_requests(self) -> bool:
        return bool(self.requests)

    @precondition(_has_requests)
    @rule(i=st.integers(0, 7), blocking=st.booleans(), layered=st.booleans())
    def restore(self, i: int, blocking: bool, layered: bool) -> None:
        req = self.requests[i % len(self.requests)]
        if req.state is not ReqState.ADMITTED:
            self._refused(req, lambda: self.c.start_restore(req))
            return
        if blocking and not self.scheduled:
            self.c.restore(req)
        else:  # layered: as the engine asks on CPU (no events to record; pages named early)
            pending = self.c.start_restore(req, layer_events=() if layered else None)
            if pending is not None:
                self.started.append(pending)
            _note(f"restore #{req.id}: {None if pending is None else pending.plan}, layered {layered}")

    @precondition(_has_requests)
    @rule(i=st.integers(0, 7), extra=st.integers(0, 2))
    def allocate(self, i: int, extra: int) -> None:
        """Private pages in any state that allows them (ahead of a layered prefill, for the
        tail, for decode); refused in the others."""
        req = self.requests[i % len(self.requests)]
        if req.state in (ReqState.LOADING_L3, ReqState.RELEASED):
            self._refused(req, lambda: self.c.allocate(req, 1))
            return
        if self._never_fits(req, extra):
            self._refused(req, lambda: self.c.allocate(req, extra))
            return
        pages = self.c.allocate(req, extra)
        _note(f"allocate #{req.id} {extra}: {pages}")
        if pages:
            self._fill(req.tokens, len(req.tokens) // G.page_size + 8, pages)  # decode-side junk

    @precondition(_has_requests)
    @rule(i=st.integers(0, 7))
    def prefill_and_insert(self, i: int) -> None:
        req = self.requests[i % len(self.requests)]
        if req.state not in (ReqState.ADMITTED, ReqState.READY, ReqState.PREFILLING):
            self._refused(req, lambda: self.c.insert(req, []))
            return
        ps = G.page_size
        n = -(-len(req.tokens) // ps) - req.cached_len // ps
        if n == 0:  # all cached, no tail: nothing to allocate
            self.c.insert(req, [])
            return
        if self._never_fits(req, n):
            self._refused(req, lambda: self.c.allocate(req, n))
            return
        pages = self.c.allocate(req, n)
        if pages is None:
            _note(f"prefill #{req.id}: no room for {n} pages")
            return
        self._fill(req.tokens, req.cached_len // ps, pages)
        self.c.insert(req, pages[: len(req.tokens) // ps - req.cached_len // ps])
        _note(f"insert #{req.id}: cached_len {req.cached_len}")

    def _loading(self) -> list[Request]:
        return [r for r in self.requests if r.state in (ReqState.LOADING_L2, ReqState.LOADING_L3)]

    def _has_restoring(self) -> bool:
        # NOTE: on real backends a restore lands when its I/O thread is done: a precondition
        # that read that would enable rules by timing, and hypothesis, replaying an example,
        # would draw differently (FlakyStrategyDefinition). There any request enables the
        # rule, which does nothing when no restore is in flight.
        return bool(self.requests) if not self.scheduled else bool(self._loading())

    @precondition(_has_restoring)
    @rule(i=st.integers(0, 7))
    def abort_restoring(self, i: int) -> None:
        """Abort a request whose restore is in flight (withdrawn if its copy has not started)."""
        loading = self._loading()
        if not loading:  # real backends: every restore landed already
            _note("abort_restoring: no restore in flight")
            return
        self.release(self.requests.index(loading[i % len(loading)]))

    @precondition(_has_requests)
    @rule(i=st.integers(0, 7))
    def release(self, i: int) -> None:
        """Finish or abort, in whatever state the request is (a restore in flight too)."""
        req = self.requests.pop(i % len(self.requests))
        _note(f"release #{req.id} ({req.state.value})")
        self.c.release(req)

    def _has_queued(self) -> bool:
        return any(m.queue for m in self.movers)

    @precondition(_has_queued)
    @rule(which=st.integers(0, 1), i=st.integers(0, 7), ok=st.sampled_from([True, True, False]))
    def finish_transfer(self, which: int, i: int, ok: bool) -> None:
        movers = [m for m in self.movers if m.queue]
        movers[which % len(movers)].finish(i, ok)
        self._poll()

    def _has_device_queued(self) -> bool:
        return bool(self.movers and self.movers[0].queue)

    @precondition(_has_device_queued)
    @rule()
    def complete_oldest_copy(self) -> None:
        """L1 <-> L2 copies land soon and in order; storage I/O (only ``finish_transfer``)
        stays in flight longer, as a disk does."""
        self.movers[0].finish(0, True)
        self._poll()

    @rule()
    def poll(self) -> None:
        self._poll()

    @rule(tier=st.sampled_from(Tier), n=st.sampled_from([1, 2, 100]))
    def evict(self, tier: Tier, n: int) -> None:
        self.c.core.evict(tier, n)

    @rule(kind=st.sampled_from(["eio", "enospc", "short", "eof", "corrupt", "fail"]))
    def inject_fault(self, kind: FaultKind) -> None:
        if not self.scheduled:
            self.c.faults.add(kind)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        if self.cache is not None:
            self.c.check_integrity()

    @invariant()
    def withdrawn_copies_never_land(self) -> None:
        """A copy the mover's ``cancel`` withdrew writes nothing (real machine)."""
        if self.checked is not None:
            self.checked.recheck()
            assert not self.checked.landed, self.checked.landed[0]

    @invariant()
    def usable_pages_hold_the_request_prefix(self) -> None:
        """Invariant 3: what a request may read (its prefix pages) is already published
        and holds exactly its own prefix's content."""
        ps = G.page_size
        for req in self.requests:
            pages = self.c.prefix_pages(req)
            assert len(pages) == req.cached_len // ps
            for j, p in enumerate(pages):
                want = page_content(req.tokens[: (j + 1) * ps])
                got = self.c.l1.buffer[:, :, p]
                assert torch.equal(got, want), (
                    f"request #{req.id} page {j} (L1 {p}) holds wrong content: {wrong_content(got, want)}"
                )

    @invariant()
    def a_layered_restore_publishes_the_pages_it_named(self) -> None:
        """The pages a layered restore named at its start (what the engine's early prefill
        reads) are, once it is done, the request's prefix pages."""
        for req in self.requests:
            r = req.restore
            if r is not None and r.pages is not None and r.done:
                assert self.c.prefix_pages(req)[: len(r.pages)] == r.pages, f"request #{req.id}"

    @invariant()
    def published_pages_hold_their_prefix(self) -> None:
        if self.cache is None:
            return
        tree = self.c.core.tree
        stack: list[tuple[Node, tuple[int, ...]]] = [(c, ()) for c in tree.root.children.values()]
        while stack:
            node, above = stack.pop()
            full = above + node.key
            for tier in (Tier.L1, Tier.L2):
                pages = node.pages[tier]
                for j, p in enumerate(pages or ()):
                    want = page_content(full[: len(above) + (j + 1) * G.page_size])
                    got = self.c.l1.buffer[:, :, p] if tier is Tier.L1 else self.c.l2.page_buffer[p]
                    assert torch.equal(got, want), (
                        f"{tier.name} page {p} of {node!r} holds wrong content: {wrong_content(got, want)}"
                    )
            stack.extend((c, full) for c in node.children.values())

    def teardown(self) -> None:
        if self.cache is None:
            return
        self._poll()  # NOTE: one more: what the last poll returned must not come again
        self.c.check_integrity()
        self.c.close()  # with transfers still queued: withdrawn or drained
        self.withdrawn_copies_never_land()  # close withdraws the backups not started
        st_ = self.c.core.status()
        assert st_.leases == 0 and st_.tiers[0].private == 0 and sum(st_.transfers_in_flight.values()) == 0
        self.c.core.check_integrity()
        type(self).coverage.update(self.c.core.tree.coverage)
        type(self).request_coverage.update(self.c.controller.request_coverage)


class SharedStoreMachine(FacadeMachine):
    """The facade over a shared, keyed L3 that other instances write and evict behind its
    back: pages appear (admission discovers them) and vanish (a read finds them lost)."""

    shared = True
    coverage: ClassVar[Counter[tuple[RunState, Event]]] = Counter()
    request_coverage: ClassVar[Counter[tuple[ReqState, ReqEvent]]] = Counter()
    stores_seen: ClassVar[Counter[str]] = Counter()


class RealBackendsMachine(FacadeMachine):
    """The real CPU backends on their own threads, with injected faults."""

    scheduled = False
    coverage: ClassVar[Counter[tuple[RunState, Event]]] = Counter()
    request_coverage: ClassVar[Counter[tuple[ReqState, ReqEvent]]] = Counter()
    stores_seen: ClassVar[Counter[str]] = Counter()


def sweep_recipes(
    machine: type[FacadeMachine] | None = FacadeMachine, shared: type[FacadeMachine] | None = SharedStoreMachine
) -> None:
    """Every recipe followed by every follow-up, then closed: each page-run state meets each
    kind of next event at least once (the random machines add the interleavings). A broken
    check raises AssertionError naming the recipe and the follow-up. None leaves a machine out."""
    runs = [] if machine is None else [(machine, r, t) for r in sorted(RECIPES) for t in FOLLOW_UPS]
    if shared is not None:
        runs += [(shared, r, t) for r in sorted(SHARED_RECIPES) for t in ("none", "settle", "abort_all")]
    for cls, recipe, then in runs:
        m = cls()
        try:
            m.seed(sizes=SIZES[0], policy="write_through", seeds=[[0, 0]], drop=(), recipe=recipe, then=then)
            m.integrity()
            m.usable_pages_hold_the_request_prefix()
            m.published_pages_hold_their_prefix()
            m.teardown()
        except (AssertionError, HiCacheError) as exc:
            if isinstance(exc, ConfigError) and m.cache is None:
                raise  # the embedder's pool, mover or store, refused before any recipe step
            raise AssertionError(f"{cls.__name__}: recipe {recipe!r} then {then!r}: {exc}") from exc


class Machines(NamedTuple):
    """The three facade machines over one choice of backends."""

    scheduled: type[FacadeMachine]
    shared: type[FacadeMachine]
    real: type[FacadeMachine]


def machines_over(
    l1: Callable[[KVGeometry, int], torch.Tensor] | None = None,
    device: Callable[[HiCache], DeviceMover] | None = None,
    store: Callable[[HostPool], PageStore] | None = None,
) -> Machines:
    """The three machines with ``l1(geometry, pages)`` as the L1 pool, ``device(cache)`` as
    the L1 <-> L2 mover and ``store(l2)`` as the L3 store (None: ours; a store for the shared
    machine also takes ``add`` and ``drop``, :meth:`FacadeMachine.make_store`), each with
    coverage counters of its own."""

    def bind(base: type[FacadeMachine]) -> type[FacadeMachine]:
        body: dict[str, Any] = {"coverage": Counter(), "request_coverage": Counter(), "stores_seen": Counter()}
        if l1 is not None:
            body["make_l1"] = lambda self, geometry, pages: l1(geometry, pages)
        if device is not None:
            body["make_device"] = lambda self, cache: device(cache)
        if store is not None:
            body["make_store"] = lambda self, host: store(host)
        return type(base.__name__, (base,), body)

    return Machines(bind(FacadeMachine), bind(SharedStoreMachine), bind(RealBackendsMachine))


def missing_transitions(machines: Iterable[type[FacadeMachine]]) -> tuple[list[str], list[str]]:
    """The page-run and the request transitions none of ``machines`` has taken so far.

    Where every L3 store the machines ran over is shared, so persistent (it outlives the
    cache, as a ``dir`` or Mooncake store does), ``cancel_h2s`` is not asked for: the machines
    reach it only by a backup not yet started that ``close`` withdraws, which a cache does only
    to a store that goes with it (the other way, a backup past its deadline at ``close``, needs
    I/O past a deadline, which the machines do not model). Where none of ``machines`` is
    the shared one (an unkeyed store, say, which it cannot run over), ``discover`` and
    ``lose`` are not asked for either: only a store other instances write reaches them."""
    runs: Counter[tuple[RunState, Event]] = Counter()
    reqs: Counter[tuple[ReqState, ReqEvent]] = Counter()
    stores: Counter[str] = Counter()
    machines = list(machines)
    for m in machines:
        runs += m.coverage
        reqs += m.request_coverage
        stores += m.stores_seen
    unreachable = {Event.CANCEL_H2S} if stores and not stores["transient"] else set()
    if not any(m.shared for m in machines):
        unreachable |= {Event.DISCOVER, Event.LOSE}
    return (
        sorted(f"{s.name} --{e.value}-->" for (s, e) in TABLE if (s, e) not in runs and e not in unreachable),
        sorted(f"{s.value} --{e.value}-->" for (s, e) in REQUEST_TABLE if (s, e) not in reqs),
    )
