"""A hung L3 read through the facade: the request recomputes at the deadline, and the run
keeps its transfer (the pages the I/O may still write stay out of use) until the I/O returns."""

from __future__ import annotations

import torch

from hicache import HiCache, HiCacheConfig
from hicache.core.controller import Outcome
from hicache.core.geometry import KVGeometry
from hicache.core.node import Node
from hicache.spec.model import Direction, Tier
from tests.backends.store_helpers import eventually

G = KVGeometry(2, 2, 8, 2, torch.float32)
TOKENS = list(range(8))


def _only_in_l3() -> HiCache:
    """A cache whose one run (TOKENS) is only in L3, its next read set to hang."""
    c = HiCache(
        HiCacheConfig(
            G, l1_pages=8, l2_pages=8, l3_pages=8, policy="always", device="cpu", tracing=True, storage_deadline_s=0.2
        )
    )
    req = c.admit(TOKENS)
    pages = c.allocate(req, len(TOKENS) // G.page_size)
    assert pages is not None
    c.l1.buffer[:, :, pages] = 1.0
    c.insert(req, pages)
    c.release(req)
    c.drain()
    c.core.evict(Tier.L1, 10**6)
    c.core.evict(Tier.L2, 10**6)
    assert c.admit(TOKENS).hit == (0, 0, len(TOKENS))
    c.faults.add("hang", op="read")
    return c


def _reading(c: HiCache) -> bool:
    """Whether the run of TOKENS still has its S2H in flight."""
    node: Node | None = c.core.match(TOKENS).l3.node
    assert node is not None and node.state is not None
    return Direction.S2H in node.state.in_flight


def test_a_hung_read_fails_the_restore_at_its_deadline_and_holds_its_pages_until_it_returns() -> None:
    """Past the deadline the restore fails and the request may recompute at once (counted as
    a deadline failure); the S2H stays on the run, with its L2 destination pages pending, until
    the hung read returns; then it ends, the pages go back and integrity holds throughout."""
    c = _only_in_l3()
    req = c.admit(TOKENS)
    pending = c.start_restore(req)
    assert pending is not None and pending.plan.tier is Tier.L3
    assert eventually(lambda: bool(c.poll()) or pending.finished)
    assert pending.outcome is Outcome.FAILED and c.metrics.l3_deadline_failures == 1
    c.check_integrity()
    assert _reading(c)
    free_l2 = c.core.status().tiers[Tier.L2].free
    pages = c.allocate(req, len(TOKENS) // G.page_size)  # the request recomputes meanwhile
    assert pages is not None
    c.check_integrity()
    c.faults.release()

    def settled() -> bool:
        c.poll()
        return not _reading(c)

    assert eventually(settled)
    assert c.core.status().tiers[Tier.L2].free > free_l2
    c.release(req)
    c.check_integrity()
    c.close()


def test_drain_reaps_a_read_past_its_deadline_once_its_io_returned() -> None:
    """drain() with a hung read past its deadline returns without waiting for it (the run
    still reading); once the read has returned, drain() alone frees its pages and the run's
    transfer ends (poll used to be needed: drain looked only at transfers still running)."""
    c = _only_in_l3()
    req = c.admit(TOKENS)
    pending = c.start_restore(req)
    assert pending is not None
    assert eventually(lambda: bool(c.poll()) or pending.finished)
    c.release(req)
    c.drain()  # the read still hangs: not waited for
    assert _reading(c)
    c.faults.release()
    assert eventually(lambda: all(j.l3 is not None and j.l3.settled for j in c.controller._stragglers.values()))
    c.drain()
    assert not _reading(c)
    st = c.core.status()
    assert st.tiers[Tier.L2].in_flight == 0 and st.leases == 0 and sum(st.transfers_in_flight.values()) == 0
    c.check_integrity()
    c.close()
