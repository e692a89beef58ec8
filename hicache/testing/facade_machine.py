"""A hypothesis state machine for the engine-facing :class:`~hicache.HiCache`.

Requests arrive, match, restore (asynchronously or blocking), prefill, insert and are
released or aborted at any point; write-through runs underneath; eviction hits every tier.
Transfers go through :class:`ScheduledMover`, which wraps the real CPU backends: a transfer
is queued with its destination poisoned (NaN), and the machine completes it (the real copy
runs), fails it, or leaves it in flight, in any order. With ``scheduled = False`` the real
backends run on their own (L3 on its I/O threads) and the machine injects faults instead.

Each L1 page's bytes are a content tag of the token prefix it holds. After every step:
``check_integrity()``; every live request's usable L1 pages (``prefix_pages``) hold exactly
its prefix's tags (the ordering invariant: nothing readable before it is published); every
page published in L1 or L2 holds the tag of its prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.backends.faults import FaultKind
from hicache.backends.ticket import Timings
from hicache.core.controller import Request
from hicache.core.geometry import KVGeometry
from hicache.core.node import Node
from hicache.errors import MisuseError
from hicache.facade import HiCache, HiCacheConfig
from hicache.spec.model import Tier
from hicache.spec.request import ReqState
from hicache.testing.fake_backend import page_tag

G = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype=torch.float32)


def tag_value(prefix: Sequence[int]) -> float:
    """A float32-exact content value for the page ending ``prefix``."""
    return float(page_tag(prefix) % (1 << 22) + 1)


@dataclass(eq=False)
class ScheduledTicket:
    nbytes: int
    ok: bool | None = None
    error: str | None = None
    extents: int = 0
    timings: Timings = field(default_factory=Timings)
    run: Any = None  # performs the real copy; returns True on success

    def poll(self) -> bool:
        return self.ok is not None

    def wait(self) -> bool:
        if self.ok is None:
            self.ok = bool(self.run())
        return self.ok


class ScheduledMover:
    """Queues copies on the real backends until :meth:`finish` says complete or fail."""

    def __init__(self, cache: HiCache, real: Any, direction_targets: dict[str, Any]) -> None:
        self.cache = cache
        self.real = real
        self.targets = direction_targets  # method name -> the tensor view poisoned on submit
        self.queue: list[ScheduledTicket] = []

    def _submit(self, name: str, a: Sequence[int], b: Sequence[int]) -> ScheduledTicket:
        pool, pages = self.targets[name](a, b)
        if pool is not None:
            pool[pages] = float("nan")  # destinations hold garbage until completion
        ticket = ScheduledTicket(len(a) * G.bytes_per_page, run=lambda: getattr(self.real, name)(a, b).wait())
        self.queue.append(ticket)
        return ticket

    def d2h(self, src: Sequence[int], dst: Sequence[int]) -> ScheduledTicket:
        return self._submit("d2h", src, dst)

    def h2d(self, src: Sequence[int], dst: Sequence[int], layer_events: Sequence[Any] | None = None) -> ScheduledTicket:
        return self._submit("h2d", src, dst)  # CPU: no events to record

    def write(self, host_pages: Sequence[int], slots: Sequence[int]) -> ScheduledTicket:
        return self._submit("write", host_pages, slots)

    def read(self, slots: Sequence[int], host_pages: Sequence[int]) -> ScheduledTicket:
        return self._submit("read", slots, host_pages)

    @property
    def layered(self) -> bool:
        return False

    def layer_groups(self) -> list[tuple[int, int]]:
        return [(0, G.num_layers)]

    def finish(self, i: int, ok: bool) -> None:
        ticket = self.queue.pop(i % len(self.queue))
        if ok:
            ticket.wait()
        else:
            ticket.ok, ticket.error = False, "scheduled failure"

    def close(self, *, wait: bool = True) -> None:
        self.real.close(wait=wait)

    def status(self) -> dict[str, Any]:
        return dict(self.real.status(), scheduled=len(self.queue))


class FacadeMachine(RuleBasedStateMachine):
    scheduled: ClassVar[bool] = True
    sizes: ClassVar[tuple[int, int, int]] = (8, 6, 10)

    def __init__(self) -> None:
        super().__init__()
        l1, l2, l3 = self.sizes
        self.cache = HiCache(
            HiCacheConfig(
                G,
                l1_pages=l1,
                l2_pages=l2,
                l3_pages=l3,
                policy="always",
                device="cpu",
                tracing=True,
                transfer_backend="torch",
            )
        )
        c = self.cache
        self.movers: list[ScheduledMover] = []
        if self.scheduled:
            host = c.l2.page_buffer
            dev = c.l1.buffer
            device = ScheduledMover(
                c,
                c.device,
                {
                    "d2h": lambda a, b: (host, list(b)),
                    "h2d": lambda a, b: (dev.transpose(0, 2), list(b)),
                },
            )
            assert c.storage is not None
            storage = ScheduledMover(
                c,
                c.storage,
                {
                    "write": lambda a, b: (None, []),
                    "read": lambda a, b: (host, list(b)),
                },
            )
            c.controller.device, c.controller.storage = device, storage
            self.movers = [device, storage]
        self.requests: list[Request] = []
        self.prompts: list[tuple[int, ...]] = []

    # -- helpers -----------------------------------------------------------------------------

    def _fill(self, tokens: tuple[int, ...], first_page: int, pages: Sequence[int]) -> None:
        ps = G.page_size
        for i, p in enumerate(pages):
            end = (first_page + i + 1) * ps
            self.cache.l1.buffer[:, :, p] = tag_value(tokens[:end])

    def _settle(self) -> None:
        """Complete everything queued (scheduled) or wait for it (real backends)."""
        for _ in range(100):
            for m in self.movers:
                while m.queue:
                    m.finish(0, True)
            self.cache.poll()
            st_ = self.cache.status()
            if not st_.pending_backups and not st_.pending_restores:
                return
            if not self.movers:
                import time

                time.sleep(0.002)

    # -- rules -------------------------------------------------------------------------------

    @initialize(
        seeds=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=8), min_size=1, max_size=2),
        drop=st.sampled_from([(Tier.L1,), (Tier.L1, Tier.L2)]),
    )
    def seed(self, seeds: list[list[int]], drop: tuple[Tier, ...]) -> None:
        """Prompts written through to L3, then L1 (and maybe L2) drained: restores ahead."""
        for tokens in seeds:
            self.admit(tokens)
            self.prefill_and_insert(len(self.requests) - 1)
            self._settle()
            self.release(len(self.requests) - 1)
        for tier in drop:
            self.cache.core.evict(tier, 10**6)

    def _has_prompts(self) -> bool:
        return bool(self.prompts)

    @precondition(_has_prompts)
    @rule(i=st.integers(0, 7))
    def readmit(self, i: int) -> None:
        """A known prompt comes back (and may now be restored from L2/L3)."""
        self.admit(list(self.prompts[i % len(self.prompts)]))

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8))
    def admit(self, tokens: list[int]) -> None:
        req = self.cache.admit(tokens)
        self.requests.append(req)
        if req.tokens not in self.prompts:
            self.prompts.append(req.tokens)
        note(f"admit #{req.id} {req.tokens}: hit {req.hit}")

    def _has_requests(self) -> bool:
        return bool(self.requests)

    @precondition(_has_requests)
    @rule(i=st.integers(0, 7), blocking=st.booleans(), layered=st.booleans())
    def restore(self, i: int, blocking: bool, layered: bool) -> None:
        req = self.requests[i % len(self.requests)]
        if req.state is not ReqState.ADMITTED:
            with pytest.raises(MisuseError):
                self.cache.start_restore(req)
            return
        if blocking and not self.scheduled:
            self.cache.restore(req)
        else:  # layered: as the engine asks on CPU (no events to record; pages named early)
            pending = self.cache.start_restore(req, layer_events=() if layered else None)
            note(f"restore #{req.id}: {None if pending is None else pending.plan}, layered {layered}")

    @precondition(_has_requests)
    @rule(i=st.integers(0, 7))
    def prefill_and_insert(self, i: int) -> None:
        req = self.requests[i % len(self.requests)]
        if req.state not in (ReqState.ADMITTED, ReqState.READY):
            return
        ps = G.page_size
        n = len(req.tokens) // ps - req.cached_len // ps
        if n == 0:
            return
        pages = self.cache.allocate(req, n)
        if pages is None:
            note(f"prefill #{req.id}: no room for {n} pages")
            return
        self._fill(req.tokens, req.cached_len // ps, pages)
        self.cache.insert(req, pages)
        note(f"insert #{req.id}: cached_len {req.cached_len}")

    @precondition(_has_requests)
    @rule(i=st.integers(0, 7))
    def release(self, i: int) -> None:
        """Finish or abort (also with a restore in flight)."""
        req = self.requests.pop(i % len(self.requests))
        note(f"release #{req.id}")
        self.cache.release(req)

    def _has_queued(self) -> bool:
        return any(m.queue for m in self.movers)

    @precondition(_has_queued)
    @rule(which=st.integers(0, 1), i=st.integers(0, 7), ok=st.sampled_from([True, True, False]))
    def finish_transfer(self, which: int, i: int, ok: bool) -> None:
        movers = [m for m in self.movers if m.queue]
        movers[which % len(movers)].finish(i, ok)
        self.cache.poll()

    @rule()
    def poll(self) -> None:
        self.cache.poll()

    @rule(tier=st.sampled_from(Tier), n=st.sampled_from([1, 2, 100]))
    def evict(self, tier: Tier, n: int) -> None:
        self.cache.core.evict(tier, n)

    @rule(kind=st.sampled_from(["eio", "enospc", "short", "eof", "corrupt", "fail"]))
    def inject_fault(self, kind: FaultKind) -> None:
        if not self.scheduled:
            self.cache.faults.add(kind)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity()

    @invariant()
    def usable_pages_hold_the_request_prefix(self) -> None:
        """Invariant 3: what a request may read (its prefix pages) is already published
        and holds exactly its own prefix's content."""
        ps = G.page_size
        for req in self.requests:
            pages = self.cache.prefix_pages(req)
            assert len(pages) == req.cached_len // ps
            for j, p in enumerate(pages):
                want = tag_value(req.tokens[: (j + 1) * ps])
                got = self.cache.l1.buffer[:, :, p]
                assert bool((got == want).all()), f"request #{req.id} page {j} (L1 {p}) holds wrong content"

    @invariant()
    def a_layered_restore_publishes_the_pages_it_named(self) -> None:
        """The pages a layered restore named at its start (what the engine's early prefill
        reads) are, once it is done, the request's prefix pages."""
        for req in self.requests:
            r = req.restore
            if r is not None and r.pages is not None and r.stage == "done":
                assert self.cache.prefix_pages(req)[: len(r.pages)] == r.pages, f"request #{req.id}"

    @invariant()
    def published_pages_hold_their_prefix(self) -> None:
        tree = self.cache.core.tree
        stack: list[tuple[Node, tuple[int, ...]]] = [(c, ()) for c in tree.root.children.values()]
        while stack:
            node, above = stack.pop()
            full = above + node.key
            for tier, view in ((Tier.L1, self.cache.l1.buffer.transpose(0, 2)), (Tier.L2, self.cache.l2.page_buffer)):
                pages = node.pages[tier]
                for j, p in enumerate(pages or ()):
                    want = tag_value(full[: len(above) + (j + 1) * G.page_size])
                    assert bool((view[p] == want).all()), f"{tier.name} page {p} of {node!r} holds wrong content"
            stack.extend((c, full) for c in node.children.values())

    def teardown(self) -> None:
        for m in self.movers:
            while m.queue:
                m.finish(0, True)
        self.cache.check_integrity()
        self.cache.close()
        assert self.cache.core.status().leases == 0
        self.cache.core.check_integrity()


class RealBackendsMachine(FacadeMachine):
    """The real CPU backends on their own threads, with injected faults."""

    scheduled = False
