"""CUDA transfer engine: bit-exact round trips, stream ordering, lazy pinned workspaces."""

from __future__ import annotations

import pytest
import torch

from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.storage import StorageBackend, StorageFile
from hicache.backends.transfer import TransferBackend, TransferEngine
from hicache.core.geometry import KVGeometry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time on the caller's stream


def make(
    page_size: int, backend: TransferBackend, dtype: torch.dtype = torch.bfloat16, pages: int = 64
) -> tuple[DevicePool, HostPool, TransferEngine]:
    g = KVGeometry(4, 2, 64, page_size, dtype)
    dev = DevicePool.allocate(g, pages, "cuda")
    dev.buffer.copy_(torch.randn(dev.buffer.shape, device="cuda").to(dtype))
    host = HostPool(g, pages)
    host.page_buffer.copy_(torch.randn(host.page_buffer.shape).to(dtype))
    return dev, host, TransferEngine(dev, host, backend)


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
@pytest.mark.parametrize("page_size", [1, 2, 16])
@pytest.mark.parametrize("fragmented", [False, True])
def test_cuda_round_trip_through_l3(backend: TransferBackend, page_size: int, fragmented: bool) -> None:
    dev, host, engine = make(page_size, backend)
    storage = StorageBackend(StorageFile(dev.geometry, 64), host)
    src = [9, 3, 40, 41, 7] if fragmented else list(range(10, 15))
    l2 = [30, 2, 17, 18, 5] if fragmented else list(range(20, 25))
    slots = [6, 1, 9, 10, 3] if fragmented else list(range(0, 5))
    back = [11, 4, 50, 51, 8] if fragmented else list(range(40, 45))
    dst = [60, 0, 33, 34, 21] if fragmented else list(range(50, 55))
    want = dev.buffer[:, :, src].clone()
    assert engine.d2h(src, l2).wait()
    assert storage.write(l2, slots).wait()
    host.page_buffer.normal_()
    assert storage.read(slots, back).wait()
    ticket = engine.h2d(back, dst)
    ticket.wait_on_current_stream()
    assert torch.equal(dev.buffer[:, :, dst], want)
    assert ticket.wait() and ticket.timings.service_s > 0
    storage.close()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_d2h_waits_for_pages_the_caller_just_wrote(backend: TransferBackend) -> None:
    """The caller's stream (a non-default one, as engines use: nothing implicit orders it
    with ours) writes L1 pages after a long kernel, then asks for D2H at once: the transfer
    stream must wait (the seed's stream bug)."""
    dev, host, engine = make(16, backend)
    engine.d2h([20, 21, 22, 23], [30, 31, 32, 33]).wait()  # warm-up: JIT and same-size buffers
    fresh = torch.randn(dev.buffer[:, :, 5:9].shape, device="cuda").to(dev.geometry.dtype)
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        dev.buffer[:, :, 5:9].copy_(fresh)  # queued on the caller's stream behind the sleep
        ticket = engine.d2h([5, 6, 7, 8], [0, 1, 2, 3])
    assert ticket.wait()
    assert torch.equal(host.buffer[:, :, 0:4], fresh.cpu())


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_h2d_waits_for_the_callers_reads_of_old_pages(backend: TransferBackend) -> None:
    """The caller still reads a page (behind a long kernel, on its own stream) when it asks
    to overwrite it by H2D: the read must see the old contents."""
    dev, host, engine = make(16, backend)
    engine.h2d([11], [4]).wait()  # warm-up
    old = dev.buffer[:, :, 3].clone()
    torch.cuda.synchronize()
    caller = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(caller):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        snapshot = dev.buffer[:, :, 3].clone()  # queued behind the sleep
        ticket = engine.h2d([10], [3])
        ticket.wait_on_current_stream()
    torch.cuda.synchronize()
    assert torch.equal(snapshot, old)
    assert torch.equal(dev.buffer[:, :, 3].cpu(), host.buffer[:, :, 10])


def test_consecutive_path_allocates_no_pinned_workspace() -> None:
    _dev, _host, engine = make(16, "auto")
    assert engine.d2h(list(range(8)), list(range(8, 16))).wait()
    assert engine.h2d(list(range(8, 16)), list(range(20, 28))).wait()
    assert engine.status()["workspace_pinned_bytes"] == 0
    assert engine.d2h([1, 5], [40, 2]).wait()
    assert engine.status()["workspace_pinned_bytes"] > 0


def test_offsets_are_64_bit() -> None:
    """A pool of more than 2**31 elements: pages past that point move correctly."""
    g = KVGeometry(2, 8, 128, 16, torch.bfloat16)  # 16 * 8 * 128 = 16384 elements per slab page
    pages = 2**31 // (4 * g.page_elements) + 64  # slabs * pages * E > 2**31
    dev = DevicePool.allocate(g, pages, "cuda")
    last = [pages - 1, pages - 2]
    dev.buffer[:, :, last].copy_(torch.randn(dev.buffer[:, :, last].shape, device="cuda").to(g.dtype))
    host = HostPool(g, 4)
    engine = TransferEngine(dev, host, "triton")
    assert dev.buffer.numel() > 2**31
    assert engine.d2h(last, [0, 1]).wait()
    assert torch.equal(host.buffer[:, :, 0:2], dev.buffer[:, :, last].cpu())
    assert engine.h2d([0, 1], [0, 1]).wait()
    torch.cuda.synchronize()
    assert torch.equal(dev.buffer[:, :, 0:2], dev.buffer[:, :, last])
