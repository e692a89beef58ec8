"""CUDA transfer engine: bit-exact round trips through the ring and the direct path,
bounded memory, failed allocations. Stream order: test_streams_gpu.py."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from hicache.backends import dma
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


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
@pytest.mark.parametrize("path", ["copy", "direct", "ring"])
@pytest.mark.parametrize("fragmented", [False, True])
@pytest.mark.parametrize("n", [1, 5, 16, 37])
def test_transfers_larger_than_the_ring_are_bit_exact(
    backend: TransferBackend, path: str, fragmented: bool, n: int
) -> None:
    """Up to several times the ring (4 slots of 2 pages), odd sizes, both paths: bit-exact,
    no other page written."""
    g = KVGeometry(4, 2, 64, 16, torch.bfloat16)
    dev = DevicePool.allocate(g, 96, "cuda")
    dev.buffer.copy_(torch.randn(dev.buffer.shape, device="cuda").to(g.dtype))
    host = HostPool(g, 96)
    host.page_buffer.copy_(torch.randn(host.page_buffer.shape).to(g.dtype))
    kw: dict[str, Any] = {
        "copy": {"copy_max_pages": 1 << 30},
        "direct": {"copy_max_pages": 0, "direct_max_bytes": 1 << 30},
        "ring": {"copy_max_pages": 0, "direct_max_bytes": 0},
    }[path]
    engine = TransferEngine(dev, host, backend, chunk_bytes=2 * g.bytes_per_page, chunks=4, min_run_bytes=0, **kw)
    rng = random.Random(n)
    src = rng.sample(range(96), n)
    l2 = rng.sample(range(96), n) if fragmented else list(range(50, 50 + n))
    dst = rng.sample(range(96), n)
    want = dev.slabs[:, src].transpose(0, 1).cpu()
    l2_before = host.slabs.clone()
    assert engine.d2h(src, l2).wait()
    assert torch.equal(host.slabs[l2], want)
    rest = [p for p in range(96) if p not in l2]
    assert torch.equal(host.slabs[rest], l2_before[rest])
    l1_before = dev.slabs.clone()
    assert engine.h2d(l2, dst).wait()
    torch.cuda.synchronize()
    assert torch.equal(dev.slabs[:, dst].transpose(0, 1).cpu(), want)
    keep = [p for p in range(96) if p not in dst]
    assert torch.equal(dev.slabs[:, keep], l1_before[:, keep])
    expect = path if path != "direct" or backend != "torch" else "ring"
    assert engine.status()["paths"][expect] == 2


def test_transfer_device_memory_is_bounded_whatever_the_size() -> None:
    """After the first transfer, a transfer of 32 times the ring allocates no device
    memory (the Triton kernels need none): the ring is the cap."""
    g = KVGeometry(4, 2, 64, 16, torch.bfloat16)
    dev = DevicePool.allocate(g, 300, "cuda")
    host = HostPool(g, 300)
    engine = TransferEngine(
        dev, host, "triton", copy_max_pages=0, direct_max_bytes=0, chunk_bytes=4 * g.bytes_per_page, chunks=2
    )
    assert engine.d2h([0], [0]).wait() and engine.h2d([0], [1]).wait()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert engine.d2h(list(range(256)), list(range(256))).wait()
    assert engine.h2d(list(range(256)), list(range(256))).wait()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == base == torch.cuda.memory_allocated()
    assert engine.status()["workspace_device_bytes"] == 8 * g.bytes_per_page


@pytest.mark.parametrize("path", ["direct", "ring"])
def test_the_index_ring_wraps_under_many_transfers_in_flight(path: str) -> None:
    """More transfers queued (behind a long kernel on the caller's stream) than the page-id
    buffers hold: a region is reused only after its transfer ended; every page right."""
    g = KVGeometry(2, 2, 64, 16, torch.bfloat16)
    dev = DevicePool.allocate(g, 64, "cuda")
    dev.buffer.copy_(torch.randn(dev.buffer.shape, device="cuda").to(g.dtype))
    host = HostPool(g, 64)
    engine = TransferEngine(
        dev, host, "triton", copy_max_pages=0, direct_max_bytes=(1 << 30) if path == "direct" else 0
    )
    assert engine.d2h([0], [0]).wait()
    assert engine._ids is not None
    rounds = engine._ids.capacity // 8 + 8
    caller: Any = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    tickets = []
    with torch.cuda.stream(caller):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        for r in range(rounds):
            pages = [(r * 8 + i) % 64 for i in range(8)]
            tickets.append(engine.d2h(pages, pages[::-1]))
    assert all(t.wait() for t in tickets)
    for r in range(rounds - 8, rounds):  # the last 8 rounds cover every page: the final bytes
        pages = [(r * 8 + i) % 64 for i in range(8)]
        assert torch.equal(host.slabs[pages[::-1]], dev.slabs[:, pages].transpose(0, 1).cpu())


def test_an_out_of_memory_fails_the_ticket_and_the_engine_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring's allocation raising OutOfMemoryError fails the transfer (no exception);
    the next one allocates and works."""
    dev, host, engine = make(16, "triton")
    engine.direct_max_bytes = engine.copy_max_pages = 0
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is not None and kwargs.get("dtype") == dev.geometry.dtype:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    ticket = engine.d2h([1, 2], [3, 4])
    assert ticket.ok is False and "out of memory" in (ticket.error or "")
    monkeypatch.setattr(torch, "empty", real)
    assert engine.d2h([1, 2], [3, 4]).wait()
    assert torch.equal(host.buffer[:, :, 3:5], dev.buffer[:, :, 1:3].cpu())


def test_no_transfer_stages_through_pinned_memory() -> None:
    _dev, _host, engine = make(16, "auto")
    assert engine.d2h(list(range(8)), list(range(8, 16))).wait()
    assert engine.h2d(list(range(8, 16)), list(range(20, 28))).wait()
    assert engine.d2h([1, 5], [40, 2]).wait()
    assert engine.status()["workspace_pinned_bytes"] == 0


@pytest.mark.parametrize("copy_max_pages", [0, 1 << 30], ids=["kernels", "copy"])
@pytest.mark.parametrize("direct_max_bytes", [0, 1 << 30], ids=["ring", "direct"])
def test_offsets_are_64_bit(direct_max_bytes: int, copy_max_pages: int) -> None:
    """A pool of more than 2**31 elements: pages past that point move correctly."""
    g = KVGeometry(2, 8, 128, 16, torch.bfloat16)  # 16 * 8 * 128 = 16384 elements per slab page
    pages = 2**31 // (4 * g.page_elements) + 64  # slabs * pages * E > 2**31
    dev = DevicePool.allocate(g, pages, "cuda")
    last = [pages - 1, pages - 2]
    dev.buffer[:, :, last] = torch.randn(dev.buffer[:, :, last].shape, device="cuda").to(g.dtype)
    host = HostPool(g, 4)
    engine = TransferEngine(dev, host, "triton", copy_max_pages=copy_max_pages, direct_max_bytes=direct_max_bytes)
    assert dev.buffer.numel() > 2**31
    assert engine.d2h(last, [0, 1]).wait()
    assert torch.equal(host.buffer[:, :, 0:2], dev.buffer[:, :, last].cpu())
    assert engine.h2d([0, 1], [0, 1]).wait()
    torch.cuda.synchronize()
    assert torch.equal(dev.buffer[:, :, 0:2], dev.buffer[:, :, last])


@pytest.mark.skipif(not dma.batch_usable(), reason="needs cudaMemcpyBatchAsync (CUDA 12.8+)")
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_fragmented_ring_dmas_go_in_one_batch_and_land_exactly(direction: str) -> None:
    """A chunk of fragmented L2 pages is one batched DMA call: the runtime accepts it (the
    engine would otherwise drop to one call per run for good), and every page lands exactly."""
    g = KVGeometry(4, 2, 64, 16, torch.bfloat16)
    dev = DevicePool.allocate(g, 64, "cuda")
    dev.buffer.copy_(torch.randn(dev.buffer.shape, device="cuda").to(g.dtype))
    host = HostPool(g, 64)
    host.page_buffer.copy_(torch.randn(host.page_buffer.shape).to(g.dtype))
    engine = TransferEngine(dev, host, "triton", copy_max_pages=0, direct_max_bytes=0, min_run_bytes=0,
                            chunk_bytes=8 * g.bytes_per_page, chunks=2)  # fmt: skip
    l1, l2 = list(range(3, 23)), list(range(40, 0, -2))  # 20 runs of one page, 3 chunks
    if direction == "d2h":
        want = dev.slabs[:, l1].transpose(0, 1).cpu()
        assert engine.d2h(l1, l2).wait()
        got = host.slabs[l2]
    else:
        want = host.slabs[l2].clone()
        assert engine.h2d(l2, l1).wait()
        got = dev.slabs[:, l1].transpose(0, 1).cpu()
    assert engine.paths["ring"] == 1
    assert dma.batch_usable()  # accepted: not dropped to one call per run
    assert torch.equal(got, want)
