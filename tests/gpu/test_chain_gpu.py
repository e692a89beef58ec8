"""The README's backend chain on CUDA (d2h -> L3 write -> L3 read -> h2d, waiting only on
the last ticket): the restored pages are the saved ones. The D2H is held back on the
transfer stream, so a storage write that did not wait for it would save stale pages."""

from __future__ import annotations

import pytest
import torch

from hicache.backends.faults import FaultInjector
from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.storage import StorageBackend, StorageFile
from hicache.backends.transfer import TransferEngine
from hicache.core.geometry import KVGeometry
from tests.backends.fenced_storage import FencedStorage

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time
G = KVGeometry(4, 2, 64, 16, torch.bfloat16)
L1_SRC, L2_A, SLOTS, L2_B, L1_DST = [1, 2, 3, 9], [4, 5, 6, 20], [7, 8, 9, 2], [10, 11, 12, 30], [13, 14, 15, 40]


def pools() -> tuple[DevicePool, HostPool]:
    l1 = DevicePool.allocate(G, 48, "cuda")
    l1.buffer.copy_(torch.randn(l1.buffer.shape, device="cuda").to(G.dtype))
    l2 = HostPool(G, 48)
    l2.page_buffer.copy_(torch.randn(l2.page_buffer.shape).to(G.dtype))
    return l1, l2


@pytest.mark.parametrize("direct_max_bytes", [0, 1 << 30], ids=["ring", "direct"])
def test_the_readme_chain_restores_the_saved_pages(direct_max_bytes: int) -> None:
    """With a storage backend that honours the L2 fences (tests/backends/fenced_storage.py)."""
    l1, l2 = pools()
    xfer = TransferEngine(l1, l2, "triton", copy_max_pages=0, direct_max_bytes=direct_max_bytes)
    storage = FencedStorage(l2, 48)
    assert xfer.d2h([0], [0]).wait()  # warm
    want = l1.slabs[:, L1_SRC].transpose(0, 1).cpu()
    with torch.cuda.stream(xfer.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # the D2H lands late
    t1 = xfer.d2h(L1_SRC, L2_A)
    t2 = storage.write(L2_A, SLOTS)
    t3 = storage.read(SLOTS, L2_B)
    t4 = xfer.h2d(L2_B, L1_DST)
    assert t4.wait()
    torch.cuda.synchronize()
    assert torch.equal(l1.slabs[:, L1_DST].transpose(0, 1).cpu(), want)
    assert torch.equal(storage.data[SLOTS], want)
    assert all(t.wait() for t in (t1, t2, t3))


def test_the_readme_chain_on_the_real_storage_backend() -> None:
    """The same on ``StorageBackend``, its read held back too."""
    l1, l2 = pools()
    xfer = TransferEngine(l1, l2, "triton")
    faults = FaultInjector()
    storage = StorageBackend(StorageFile(G, 48), l2, faults=faults)
    assert xfer.d2h([0], [0]).wait()
    want = l1.slabs[:, L1_SRC].transpose(0, 1).cpu()
    with torch.cuda.stream(xfer.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    faults.add("slow", op="read", delay_s=0.5)
    xfer.d2h(L1_SRC, L2_A)
    storage.write(L2_A, SLOTS)
    storage.read(SLOTS, L2_B)
    t4 = xfer.h2d(L2_B, L1_DST)
    try:
        assert t4.wait()
        torch.cuda.synchronize()
        assert torch.equal(l1.slabs[:, L1_DST].transpose(0, 1).cpu(), want)
    finally:
        storage.close()
