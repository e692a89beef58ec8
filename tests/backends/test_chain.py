"""The backend API is safe to chain: a transfer that names pages another transfer still
writes (or, for a write, still reads) is ordered after it, or refused, never a silent read
of bytes in flight. CPU; the GPU version is tests/gpu/test_chain_gpu.py."""

from __future__ import annotations

import pytest
import torch

from hicache.backends.faults import FaultInjector
from hicache.backends.pools import DevicePool, HostPool, PageFences, PagesInFlightError
from hicache.backends.storage import StorageBackend, StorageFile
from hicache.backends.ticket import Ticket
from hicache.backends.transfer import FencePolicy, TransferEngine
from hicache.core.geometry import KVGeometry
from hicache.errors import MisuseError
from hicache.spec.model import Direction
from tests.backends.fenced_storage import FencedStorage


def setup(fences: FencePolicy = "wait") -> tuple[DevicePool, HostPool, TransferEngine, FencedStorage]:
    g = KVGeometry(3, 2, 8, 2, torch.float32)
    gen = torch.Generator().manual_seed(0)
    l1 = DevicePool.allocate(g, 16, "cpu")
    l1.buffer.copy_(torch.randn(l1.buffer.shape, generator=gen))
    l2 = HostPool(g, 16)
    l2.page_buffer.copy_(torch.randn(l2.page_buffer.shape, generator=gen))
    return l1, l2, TransferEngine(l1, l2, "torch", fences=fences), FencedStorage(l2, 16)


def rows(l1: DevicePool, pages: list[int]) -> torch.Tensor:
    return l1.slabs[:, pages].transpose(0, 1).clone()


L1_SRC, L2_A, SLOTS, L2_B, L1_DST = [1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15]


def test_the_readme_chain_waiting_only_at_the_end_restores_the_right_pages() -> None:
    """d2h -> L3 write -> L3 read -> h2d, waiting only on the last ticket: the pages that
    land in L1 are the ones saved (the h2d waits for the read that writes its source)."""
    l1, _l2, xfer, storage = setup()
    want = rows(l1, L1_SRC)
    t1 = xfer.d2h(L1_SRC, L2_A)
    t2 = storage.write(L2_A, SLOTS)
    t3 = storage.read(SLOTS, L2_B)
    t4 = xfer.h2d(L2_B, L1_DST)
    assert t4.wait()
    assert torch.equal(rows(l1, L1_DST), want)
    assert all(t.ok for t in (t1, t2, t3))


def test_the_readme_chain_is_refused_with_fences_raise() -> None:
    """With ``fences="raise"`` the h2d of pages a read still writes raises a MisuseError
    naming them, before anything moves; once the read is waited for, it goes."""
    l1, _l2, xfer, storage = setup("raise")
    want = rows(l1, L1_SRC)
    xfer.d2h(L1_SRC, L2_A)
    storage.write(L2_A, SLOTS)
    t3 = storage.read(SLOTS, L2_B)
    before = l1.slabs.clone()
    with pytest.raises(PagesInFlightError, match=r"L2: pages \[10, 11, 12\]") as info:
        xfer.h2d([9, *L2_B], [0, *L1_DST])
    assert isinstance(info.value, MisuseError)
    assert torch.equal(l1.slabs, before)
    assert t3.wait() and xfer.h2d(L2_B, L1_DST).wait()
    assert torch.equal(rows(l1, L1_DST), want)


def test_a_d2h_waits_for_a_storage_write_still_reading_its_destination() -> None:
    """Write after read: an L3 write in flight reads L2 pages a D2H then overwrites; the
    file gets the old bytes, L2 the new."""
    l1, l2, xfer, storage = setup()
    old = l2.slabs[L2_A].clone()
    t2 = storage.write(L2_A, SLOTS)
    assert xfer.d2h(L1_SRC, L2_A).wait()
    assert t2.ok and torch.equal(storage.data[SLOTS], old)
    assert torch.equal(l2.slabs[L2_A], rows(l1, L1_SRC))


def test_a_d2h_waits_for_a_storage_read_writing_its_destination() -> None:
    """Write after write: an L3 read in flight into L2 pages a D2H then writes; the D2H's
    bytes are the ones that stay."""
    l1, l2, xfer, storage = setup()
    storage.data[SLOTS] = torch.randn(storage.data[SLOTS].shape)
    t3 = storage.read(SLOTS, L2_A)
    assert xfer.d2h(L1_SRC, L2_A).wait()
    assert t3.ok and torch.equal(l2.slabs[L2_A], rows(l1, L1_SRC))


def test_the_real_storage_backend_is_safe_to_chain() -> None:
    """The README chain on the real StorageBackend, its read held back: the h2d must wait
    for the read that writes its source pages."""
    l1, l2, xfer, _ = setup()
    faults = FaultInjector()
    storage = StorageBackend(StorageFile(l1.geometry, 16), l2, faults=faults)
    want = rows(l1, L1_SRC)
    xfer.d2h(L1_SRC, L2_A)
    storage.write(L2_A, SLOTS).wait()
    faults.add("slow", op="read", delay_s=1.0)
    storage.read(SLOTS, L2_B)
    t4 = xfer.h2d(L2_B, L1_DST)
    try:
        assert t4.wait() and torch.equal(rows(l1, L1_DST), want)
    finally:
        storage.close()


class Held(Ticket):
    """A ticket that finishes only when told to."""

    def __init__(self) -> None:
        super().__init__(Direction.S2H, 1, 1)
        self.release: bool | None = None
        self.bind(lambda block: self.release)


def test_fences_order_reads_after_writes_and_writes_after_both() -> None:
    """A read conflicts with writes in flight, a write with writes and reads; tickets
    come back in the order fenced; an owner's own fences are left out of its queries."""
    f = PageFences("L2")
    w, r, mine = Held(), Held(), Held()
    f.fence([1, 2], w, write=True)
    f.fence([3], r, write=False)
    f.fence([5], mine, write=True, owner="me")
    assert f.pending([2, 9]) == [w] and f.pending([3]) == []
    assert f.pending([1, 3], write=True) == [w, r] and f.pending([9], write=True) == []
    assert f.pending([5]) == [mine] and f.pending([5], exclude="me") == []
    assert f.pages_of(w, [0, 1, 2, 3]) == [1, 2]


def test_a_fence_ends_with_its_ticket_whoever_polls_it() -> None:
    """Finished tickets drop out (a query polls the ones it meets); await_pages says
    whether every transfer it waited for succeeded."""
    f = PageFences("L2")
    a, b = Held(), Held()
    f.fence([1], a)
    f.fence([2], b)
    a.release = True
    assert f.pending([1, 2]) == [b] and len(f) == 1
    b.release = False
    assert f.await_pages([2]) is False and len(f) == 0  # b failed
    assert f.await_pages([2]) is True  # nothing in flight any more


def test_refuse_names_the_pages_in_flight() -> None:
    f = PageFences("L1")
    t = Held()
    f.fence([7, 8], t)
    with pytest.raises(PagesInFlightError, match=r"L1: pages \[8\] are still being written by a S2H"):
        f.refuse([8, 9])
    f.refuse([9])


def test_ticket_callbacks_run_once_at_the_finish() -> None:
    """``add_done_callback`` runs at the finish (or at once if already finished), once;
    ``finish_now`` finishes without a check; ``bind`` attaches the check."""
    seen: list[bool | None] = []
    t = Ticket(Direction.H2D, 1, 1)
    t.add_done_callback(lambda x: seen.append(x.ok))
    state: list[bool | None] = [None]
    t.bind(lambda block: state[0])
    assert not t.poll() and seen == []
    state[0] = True
    assert t.poll() and t.poll() and seen == [True]
    t.add_done_callback(lambda x: seen.append(x.ok))
    assert seen == [True, True]
    u = Ticket(Direction.H2D, 1, 1)
    u.finish_now(False, "nothing to do")
    assert u.ok is False and u.error == "nothing to do" and u.wait() is False
