"""The bounded transfer ring on CPU: transfers larger than the ring, transfer memory fixed
whatever the size, allocation failures that fail the ticket, persistent index buffers, the
layered H2D's order of events."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache.backends import kernels
from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.transfer import STRAIGHT_MAX_PAGES, TransferBackend, TransferEngine, page_runs
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pools(pages: int = 24, *, layers: int = 3, seed: int = 0) -> tuple[DevicePool, HostPool]:
    g = KVGeometry(layers, 2, 4, 2, torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    l1 = DevicePool.allocate(g, pages, "cpu")
    l1.buffer.copy_(torch.randn(l1.buffer.shape, generator=gen).to(g.dtype))
    l2 = HostPool(g, pages)
    l2.page_buffer.copy_(torch.randn(l2.page_buffer.shape, generator=gen).to(g.dtype))
    return l1, l2


def engine(l1: DevicePool, l2: HostPool, chunk_pages: int, chunks: int, **kw: Any) -> TransferEngine:
    """An engine whose ring holds ``chunks`` chunks of ``chunk_pages`` pages, never direct."""
    kw.setdefault("backend", "torch")
    kw.setdefault("direct_max_bytes", 0)
    kw.setdefault("min_run_bytes", 0)
    return TransferEngine(l1, l2, chunk_bytes=chunk_pages * l1.geometry.bytes_per_page, chunks=chunks, **kw)


def no_room_for_the_ring(monkeypatch: pytest.MonkeyPatch, l1: DevicePool) -> None:
    """From now on, allocating the ring (not the index buffers) raises out of memory."""
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("dtype") == l1.geometry.dtype and args[0] != ():  # the ring, not the index buffers
            raise torch.OutOfMemoryError("no room for the ring")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)


def l1_rows(l1: DevicePool, pages: list[int]) -> torch.Tensor:
    """L1 pages in L2 page layout ``[n, 2*layers, E]``."""
    return l1.slabs[:, pages].transpose(0, 1).clone()


def round_trip(eng: TransferEngine, n: int, fragmented: bool, seed: int) -> None:
    """D2H ``n`` random L1 pages into L2 pages, then H2D them into other L1 pages: each
    step bit-exact, and nothing else written."""
    rng = random.Random(seed)
    l1, l2 = eng.l1, eng.l2
    src = rng.sample(range(l1.num_pages), n)
    if fragmented:
        l2_pages = rng.sample(range(l2.num_pages), n)
    else:
        first = rng.randrange(l2.num_pages - n + 1)
        l2_pages = list(range(first, first + n))
    want = l1_rows(l1, src)
    l2_before = l2.slabs.clone()
    assert eng.d2h(src, l2_pages).wait()
    assert torch.equal(l2.slabs[l2_pages], want)
    others = [p for p in range(l2.num_pages) if p not in l2_pages]
    assert torch.equal(l2.slabs[others], l2_before[others]), "D2H wrote other L2 pages"
    dst = rng.sample(range(l1.num_pages), n)
    l1_before = l1.slabs.clone()
    assert eng.h2d(l2_pages, dst).wait()
    assert torch.equal(l1_rows(l1, dst), want)
    rest = [p for p in range(l1.num_pages) if p not in dst]
    assert torch.equal(l1.slabs[:, rest], l1_before[:, rest]), "H2D wrote other L1 pages"


@pytest.mark.parametrize("fragmented", [False, True], ids=["consecutive", "fragmented"])
@pytest.mark.parametrize(("chunk_pages", "chunks"), [(1, 2), (2, 2), (2, 3), (4, 5)])
@pytest.mark.parametrize("n", [1, 5, 7, 11, 23])
def test_transfers_larger_than_the_ring_are_bit_exact(chunk_pages: int, chunks: int, n: int, fragmented: bool) -> None:
    """Transfers of up to several times the ring's pages (odd counts, partial last chunks,
    wrapping around the ring) move exactly the pages asked for."""
    l1, l2 = pools(seed=n)
    eng = engine(l1, l2, chunk_pages, chunks)
    round_trip(eng, n, fragmented, seed=n * 31 + chunks)
    assert eng.status()["workspace_device_bytes"] == chunk_pages * chunks * l1.geometry.bytes_per_page


@pytest.mark.parametrize("fragmented", [False, True], ids=["consecutive", "fragmented"])
@pytest.mark.parametrize(("head", "chunk_pages"), [(1, 2), (2, 2), (3, 4), (4, 3)])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 9, 23])
def test_a_d2h_moves_its_head_by_the_copy_path_and_the_rest_through_the_ring(
    monkeypatch: pytest.MonkeyPatch, head: int, chunk_pages: int, n: int, fragmented: bool
) -> None:
    """A ring D2H of at least twice ``ring_head_pages`` pages moves its first pages as the
    copy path does (one strided DMA per page, started while the ring's first gather is
    launched) and the rest through the ring; shorter ones go through the ring whole. The
    round trip is exact either way, and the split is exactly the first pages."""
    from hicache.backends import dma

    copied: list[list[tuple[int, int]]] = []
    real = dma.copy_pages

    def recorded(*args: Any) -> None:
        copied.append(list(args[8]))
        real(*args)

    monkeypatch.setattr(dma, "copy_pages", recorded)
    l1, l2 = pools(seed=n + head)
    eng = engine(l1, l2, chunk_pages, 3, ring_head_pages=head)
    rng = random.Random(n * 7 + head)
    src = rng.sample(range(l1.num_pages), n)
    l2_pages = rng.sample(range(l2.num_pages), n) if fragmented else list(range(1, 1 + n))
    want = l1_rows(l1, src)
    assert eng.d2h(src, l2_pages).wait()
    assert torch.equal(l2.slabs[l2_pages], want)
    assert copied == ([list(zip(l2_pages[:head], src[:head], strict=True))] if n >= 2 * head else [])
    assert eng.paths["ring"] == 1
    round_trip(eng, n, fragmented, seed=n + 5)


@pytest.mark.skipif(not INTERPRET, reason="CPU pools need TRITON_INTERPRET=1")
@pytest.mark.parametrize("fragmented", [False, True], ids=["consecutive", "fragmented"])
def test_the_ring_on_triton_kernels_is_bit_exact(fragmented: bool) -> None:
    """The same through the Triton gather and scatter (interpreted)."""
    l1, l2 = pools()
    eng = engine(l1, l2, 2, 2, backend="triton")
    round_trip(eng, 7, fragmented, seed=3)
    assert eng.status()["paths"]["ring"] == 2


@given(
    chunk_pages=st.integers(1, 6),
    chunks=st.integers(2, 4),
    n=st.integers(1, 24),
    fragmented=st.booleans(),
    seed=st.integers(0, 2**16),
    head=st.integers(0, 5),
)
def test_any_ring_moves_any_transfer_exactly(
    chunk_pages: int, chunks: int, n: int, fragmented: bool, seed: int, head: int
) -> None:
    """Property: whatever the ring's shape, its D2H head and the transfer's size, a round
    trip is exact."""
    l1, l2 = pools(seed=seed % 7)
    round_trip(engine(l1, l2, chunk_pages, chunks, ring_head_pages=head), n, fragmented, seed)


@pytest.mark.skipif(not INTERPRET, reason="CPU pools need TRITON_INTERPRET=1")
@pytest.mark.parametrize("fragmented", [False, True], ids=["consecutive", "fragmented"])
def test_the_direct_path_is_bit_exact(fragmented: bool) -> None:
    """Up to ``direct_max_bytes`` a transfer is one kernel on the L2 pages in place."""
    l1, l2 = pools()
    eng = TransferEngine(l1, l2, "triton", direct_max_bytes=1 << 30)
    round_trip(eng, 9, fragmented, seed=5)
    assert eng.status()["paths"] == {"copy": 0, "direct": 2, "ring": 0, "layered": 0}


def test_transfer_memory_does_not_depend_on_transfer_size() -> None:
    """The ring's cap is known at construction; the first transfer allocates exactly it
    and the index buffers, and transfers of any size later allocate nothing more."""
    l1, l2 = pools(64)
    eng = engine(l1, l2, 2, 3)
    cap = eng.status()["ring_cap_bytes"]
    assert cap == 6 * l1.geometry.bytes_per_page and eng.status()["workspace_device_bytes"] == 0
    seen = set()
    for n in (1, 2, 17, 64, 3):
        assert eng.d2h(list(range(n)), list(range(n))).wait()
        assert eng.h2d(list(range(n)), list(range(64 - n, 64))).wait()
        s = eng.status()
        seen.add((s["workspace_device_bytes"], s["workspace_pinned_bytes"], s["index_bytes"]))
    assert seen == {(cap, 0, eng.status()["index_bytes"])}


def test_index_buffers_are_persistent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Page ids go through buffers allocated once: after the first transfer no transfer
    builds a tensor of them, and the buffers stay the same (no growth)."""
    l1, l2 = pools(32)
    eng = engine(l1, l2, 4, 2)
    assert eng.d2h([0], [0]).wait()
    ids = eng._ids
    assert ids is not None
    host, capacity = ids.host.data_ptr(), ids.capacity

    def no_tensor(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a transfer built a tensor of page ids")

    monkeypatch.setattr(torch, "tensor", no_tensor)
    monkeypatch.setattr(torch, "as_tensor", no_tensor)
    for n in range(1, 33, 5):  # enough transfers to wrap the id ring
        round_trip(eng, n, fragmented=n % 2 == 1, seed=n)
    for _ in range(ids.capacity // 32 + 2):
        assert eng.d2h(list(range(32)), list(range(32))).wait()
    assert eng._ids is ids and ids.host.data_ptr() == host and ids.capacity == capacity


@pytest.mark.parametrize("failing", ["index", "ring"])
@pytest.mark.parametrize(
    "error", [torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("cudaHostAlloc failed")], ids=["oom", "other"]
)
def test_an_allocation_failure_fails_the_ticket_and_the_engine_goes_on(
    monkeypatch: pytest.MonkeyPatch, failing: str, error: Exception
) -> None:
    """An allocation that fails (the index buffers or the ring) fails that transfer's
    ticket, with the reason, instead of raising; nothing was written; it is counted; the
    next transfer allocates again and works."""
    l1, l2 = pools()
    eng = engine(l1, l2, 2, 2)
    real = torch.empty
    calls = {"n": 0}
    fail_at = 1 if failing == "index" else 2  # _Ids allocates first, then the ring

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if args and args[0] != ():  # not a dtype's item size
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    before = l2.slabs.clone()
    ticket = eng.d2h([3, 4, 5], [0, 1, 2])
    assert ticket.ok is False and ticket.poll() and not ticket.wait()
    assert ticket.error is not None and "allocation failed" in ticket.error and str(error) in ticket.error
    assert torch.equal(l2.slabs, before)
    assert eng.status()["allocation_failures"] == 1
    monkeypatch.setattr(torch, "empty", real)
    round_trip(eng, 7, fragmented=True, seed=1)
    assert eng.status()["workspace_device_bytes"] == eng.status()["ring_cap_bytes"]


@pytest.mark.skipif(not INTERPRET, reason="CPU pools need TRITON_INTERPRET=1")
def test_a_direct_transfer_goes_on_without_the_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct path needs no ring: when the ring cannot be allocated, small transfers
    still work, and a ring transfer fails its ticket."""
    l1, l2 = pools()
    eng = TransferEngine(l1, l2, "triton", direct_max_bytes=4 * l1.geometry.bytes_per_page)
    no_room_for_the_ring(monkeypatch, l1)
    want = l1_rows(l1, [1, 2])
    assert eng.d2h([1, 2], [5, 9]).wait()
    assert torch.equal(l2.slabs[[5, 9]], want)
    big = eng.d2h(list(range(8)), list(range(8)))
    assert big.ok is False and "ring" in (big.error or "")
    assert eng.status()["paths"]["direct"] == 1


class FakeEvent:
    """Stands for a ``torch.cuda.Event``: at each record, snapshots which layers of the
    restored pages already hold their final bytes."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.records: list[frozenset[int]] = []

    def record(self, stream: object = None) -> None:
        self.records.append(self.probe())


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRET, reason="interpreter"))]
)
@pytest.mark.parametrize("fragmented", [False, True], ids=["consecutive", "fragmented"])
@pytest.mark.parametrize("chunk_pages", [1, 4])
def test_layered_h2d_records_each_event_after_its_layers_of_every_page(
    monkeypatch: pytest.MonkeyPatch, backend: TransferBackend, fragmented: bool, chunk_pages: int
) -> None:
    """The layered H2D (its address arithmetic run on CPU): each layer's event is recorded
    once every page's K and V of that layer (and of no later group) has landed, in units
    of a ring slot (a small ring: several units per group); the pages end bit-exact."""
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    l1, l2 = pools(24, layers=7)
    eng = engine(l1, l2, chunk_pages, 2, backend=backend, layer_group=1, max_layer_group=4, scatter_programs=2)
    layers = l1.geometry.num_layers
    rng = random.Random(chunk_pages)
    l2_pages = rng.sample(range(24), 9) if fragmented else list(range(4, 13))
    dst = rng.sample(range(24), 9)
    want = l2.slabs[l2_pages].clone()  # [n, 2*L, E]

    def landed() -> frozenset[int]:
        got = l1.slabs[:, dst].transpose(0, 1)
        return frozenset(x for x in range(layers) if torch.equal(got[:, [x, layers + x]], want[:, [x, layers + x]]))

    events = [FakeEvent(landed) for _ in range(layers)]
    l1.slabs.zero_()  # nothing has landed yet
    assert eng.h2d(l2_pages, dst, layer_events=events).wait()
    assert eng.status()["paths"]["layered"] == 1
    for lo, hi in eng.layer_groups():
        for x in range(lo, hi):
            (seen,) = events[x].records
            assert seen == frozenset(range(hi)), (x, sorted(seen))
    assert torch.equal(l1.slabs[:, dst].transpose(0, 1), want)


def layered_h2d_exactly(
    eng: TransferEngine, l1: DevicePool, l2: HostPool, src: list[int], dst: list[int]
) -> dict[str, Any]:
    """Run a layered H2D of L2 pages ``src`` into L1 pages ``dst`` (into a zeroed L1) and
    check it: each layer's event recorded once its group of layers (and no later one) has
    landed in every page, the pages bit-exact, nothing else in L1 or L2 changed. Returns
    the engine's status after it."""
    layers = l1.geometry.num_layers
    want = l2.slabs[src].clone()
    others = sorted(set(range(l1.num_pages)) - set(dst))

    def landed() -> frozenset[int]:
        got = l1.slabs[:, dst].transpose(0, 1)
        return frozenset(x for x in range(layers) if torch.equal(got[:, [x, layers + x]], want[:, [x, layers + x]]))

    events = [FakeEvent(landed) for _ in range(layers)]
    l1.slabs.zero_()
    before, l2_before = l1.slabs[:, others].clone(), l2.slabs.clone()
    assert eng.h2d(src, dst, layer_events=events).wait()
    for lo, hi in eng.layer_groups():
        for x in range(lo, hi):
            (seen,) = events[x].records
            assert seen == frozenset(range(hi)), (x, sorted(seen))
    assert torch.equal(l1.slabs[:, dst].transpose(0, 1), want)
    assert torch.equal(l1.slabs[:, others], before)
    assert torch.equal(l2.slabs, l2_before)
    return dict(eng.status())


STRAIGHT_LAYOUTS = {  # (L2 pages, L1 pages, runs over which both step by one)
    "one run": (list(range(4, 13)), list(range(10, 19)), 1),
    "two runs": ([4, 5, 6, 7, 8, 15, 16, 17, 18], [10, 11, 12, 13, 14, 2, 3, 4, 5], 2),
    "three runs": ([4, 5, 6, 15, 16, 17, 20, 21, 22], [10, 11, 12, 2, 3, 4, 7, 8, 9], 3),
    "L2 consecutive, L1 not": (list(range(4, 13)), [10, 11, 12, 0, 1, 2, 20, 21, 22], 3),
    "L1 consecutive, L2 not": ([4, 5, 6, 7, 8, 15, 16, 17, 18], list(range(10, 19)), 2),
}


@pytest.mark.parametrize("layout", sorted(STRAIGHT_LAYOUTS))
@pytest.mark.parametrize(("straight_runs", "max_pages"), [(0, 32), (2, 32), (3, 32), (3, 9), (3, 8), (3, 0)])
@pytest.mark.parametrize("d2d_runs", [0, 1, 2, 3])
def test_a_layered_h2d_goes_through_the_ring_by_row_dmas_or_straight_into_l1(
    monkeypatch: pytest.MonkeyPatch, layout: str, straight_runs: int, max_pages: int, d2d_runs: int
) -> None:
    """A layered H2D into L1 pages forming at most ``d2d_runs`` runs goes through the ring
    and out of its slots by row DMAs; else, if it is at most ``straight_max_pages`` pages
    forming at most ``straight_runs`` runs in both pools, straight into L1 (no ring, no
    scatter); else through the ring and the scatter kernel (address arithmetic run on CPU).
    Every way each layer's event is recorded once that layer of every page (and no later
    group's layer) has landed, and the pages end bit-exact, nothing else written."""
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    l1, l2 = pools(24, layers=7, seed=5)
    eng = engine(
        l1,
        l2,
        4,
        2,
        layer_group=1,
        max_layer_group=4,
        straight_runs=straight_runs,
        straight_max_pages=max_pages,
        d2d_runs=d2d_runs,
        d2d_min_bytes=0,
    )
    l2_pages, dst, runs = STRAIGHT_LAYOUTS[layout]
    rows = bool(d2d_runs) and len(page_runs(dst)) <= d2d_runs
    status = layered_h2d_exactly(eng, l1, l2, l2_pages, dst)
    assert status["paths"]["layered"] == 1 and status["straight_runs"] == straight_runs
    assert (status["straight_max_pages"], status["d2d_runs"]) == (max_pages, d2d_runs)
    assert status["d2d"] == int(rows)
    assert status["straight"] == (1 if not rows and runs <= straight_runs and len(dst) <= max_pages else 0)
    assert status["workspaces"] == int(not status["straight"])


@pytest.mark.parametrize("count", [1, 2, 3])
def test_row_dmas_fill_each_l1_run_from_units_that_straddle_it(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Slots smaller than a group's pages (units of 2 pages against runs of 3 and 5) and
    groups of several layers: each unit's rows land in the right run, layer and K/V row,
    and only there."""
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    l1, l2 = pools(24, layers=7, seed=count)
    eng = engine(l1, l2, 1, 3, layer_group=count, max_layer_group=4, d2d_runs=2, d2d_min_bytes=0)
    status = layered_h2d_exactly(eng, l1, l2, [9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 2, 3, 4, 5, 6])
    assert (status["d2d"], status["straight"]) == (1, 0)


@pytest.mark.parametrize("pages", [4, 5, 6])
def test_row_dmas_only_from_d2d_min_bytes(monkeypatch: pytest.MonkeyPatch, pages: int) -> None:
    """Below ``d2d_min_bytes`` a layered H2D that can go straight does; from it on, by row
    DMAs out of the ring. Bit-exact either way."""
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    l1, l2 = pools(24, layers=3)
    eng = engine(l1, l2, 4, 2, d2d_runs=2, d2d_min_bytes=5 * l1.geometry.bytes_per_page)
    status = layered_h2d_exactly(eng, l1, l2, list(range(4, 4 + pages)), list(range(12, 12 + pages)))
    assert (status["d2d"], status["straight"]) == ((0, 1) if pages < 5 else (1, 0))


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRET, reason="interpreter"))]
)
def test_fragmented_l2_pages_go_straight_rather_than_by_loads_when_they_can(
    monkeypatch: pytest.MonkeyPatch, backend: TransferBackend
) -> None:
    """L1 one run, L2 two: where Triton can load L2 pages in place (zero-copy, on the SMs)
    the slots are not used, so no row DMAs: the restore goes straight, as it can. Without
    Triton the slots are filled by a DMA per L2 run and emptied by row DMAs."""
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    loads: list[object] = []
    real = kernels.load_layers_triton

    def spy(*args: Any, **kwargs: Any) -> None:
        loads.append(args)
        real(*args, **kwargs)

    monkeypatch.setattr(kernels, "load_layers_triton", spy)
    l1, l2 = pools(24, layers=3)
    eng = engine(l1, l2, 4, 2, backend=backend, d2d_runs=2, d2d_min_bytes=0)
    status = layered_h2d_exactly(eng, l1, l2, [2, 3, 4, 10, 11, 12], list(range(14, 20)))
    rows = backend == "torch"
    assert (status["straight"], status["d2d"], bool(loads)) == (int(not rows), int(rows), False)


def test_a_failed_setup_that_kept_the_ring_still_sends_layered_h2ds_straight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring allocated, then the kernel choice out of memory: the restore goes straight,
    and so do the next ones (the ring is there, but its setup failed)."""
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    l1, l2 = pools(24, layers=3)
    eng = engine(l1, l2, 4, 2, d2d_runs=2, d2d_min_bytes=0)

    def choose() -> None:
        raise torch.OutOfMemoryError("no room for the autotune")

    monkeypatch.setattr(eng, "_choose", choose)
    for _ in range(3):
        status = layered_h2d_exactly(eng, l1, l2, [4, 5, 6], [10, 11, 12])
    assert (status["straight"], status["d2d"], status["allocation_failures"]) == (3, 0, 1)


def test_each_layered_way_counts_its_first_enqueue_as_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Straight needs no setup, row DMAs (and the scatter) the ring: a straight restore
    first does not make the first one by row DMAs, which allocates the ring, look recurring."""
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    l1, l2 = pools(24, layers=3)
    eng = engine(l1, l2, 4, 2, d2d_runs=2, d2d_min_bytes=4 * l1.geometry.bytes_per_page)
    events = [FakeEvent(frozenset) for _ in range(3)]
    setup = []
    for src, dst in (([4, 5, 6], [10, 11, 12]), ([4, 5, 6, 7], [10, 11, 12, 13]), ([4, 5, 6, 7], [10, 11, 12, 13])):
        ticket = eng.h2d(src, dst, layer_events=events)
        assert ticket.wait()
        setup.append(ticket.timings.setup_s == ticket.timings.enqueue_s > 0)
    assert setup == [True, True, False] and (eng.straight, eng.d2d) == (1, 2)


def test_a_layered_h2d_goes_straight_when_the_ring_cannot_be_had_and_stops_asking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Row DMAs need the ring; where it cannot be allocated a layered H2D that can go
    straight does (bit-exact), the failure is counted once and later ones do not ask again."""
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    l1, l2 = pools(24, layers=3)
    eng = engine(l1, l2, 4, 2, d2d_runs=2, d2d_min_bytes=0)
    calls: list[str] = []
    real = eng._setup

    def setup(path: Any) -> None:
        calls.append(path)
        real(path)

    monkeypatch.setattr(eng, "_setup", setup)
    no_room_for_the_ring(monkeypatch, l1)
    for _ in range(2):
        status = layered_h2d_exactly(eng, l1, l2, [4, 5, 6], [10, 11, 12])
    assert (status["straight"], status["d2d"], status["workspaces"]) == (2, 0, 0)
    assert status["allocation_failures"] == 1 and calls == ["layered"]


@pytest.mark.parametrize("name", ["straight_runs", "straight_max_pages", "d2d_runs", "d2d_min_bytes"])
@pytest.mark.parametrize("bad", [-1, True, 1.5, "2", None])
def test_straight_limits_must_be_non_negative_ints(name: str, bad: object) -> None:
    """At construction and when set later (the benchmarks set them on a built engine);
    a refused value leaves the setting as it was."""
    l1, l2 = pools()
    with pytest.raises(ConfigError, match=name):
        TransferEngine(l1, l2, "torch", **{name: bad})  # type: ignore[arg-type]
    eng = TransferEngine(l1, l2, "torch", straight_runs=1, straight_max_pages=5, d2d_runs=3, d2d_min_bytes=7)
    with pytest.raises(ConfigError, match=name):
        setattr(eng, name, bad)
    assert (eng.straight_runs, eng.straight_max_pages, eng.d2d_runs, eng.d2d_min_bytes) == (1, 5, 3, 7)


def test_a_straight_h2d_needs_no_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ring is set up for it: where the ring cannot be allocated, the straight H2D still
    lands (bit-exact) and a ring transfer after it fails on the allocation."""
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    l1, l2 = pools(24, layers=3)
    eng = engine(l1, l2, 4, 2)
    no_room_for_the_ring(monkeypatch, l1)
    events = [FakeEvent(frozenset) for _ in range(3)]
    assert eng.h2d([4, 5, 6], [10, 11, 12], layer_events=events).wait()
    assert torch.equal(l1.slabs[:, [10, 11, 12]].transpose(0, 1), l2.slabs[[4, 5, 6]])
    status = eng.status()
    assert (status["straight"], status["workspaces"], status["workspace_device_bytes"]) == (1, 0, 0)
    ring = eng.h2d([4, 5, 6], [1, 3, 7], layer_events=events)  # three runs: through the ring
    assert ring.ok is False and "ring" in (ring.error or "")


def test_a_straight_h2d_takes_its_injected_read_fault() -> None:
    """A ``fail`` fault for reads fails the straight H2D's ticket once; the next one lands."""
    from hicache.backends.faults import FaultInjector

    faults = FaultInjector()
    faults.add("fail", op="read")
    l1, l2 = pools(24, layers=3)
    eng = engine(l1, l2, 4, 2, faults=faults, d2d_runs=0)
    eng.__class__ = type("Layered", (TransferEngine,), {"layered": property(lambda self: True)})
    events = [FakeEvent(frozenset) for _ in range(3)]
    first = eng.h2d([4, 5, 6], [10, 11, 12], layer_events=events)
    assert first.wait() is False and first.error == "injected transfer failure"
    assert eng.h2d([4, 5, 6], [10, 11, 12], layer_events=events).wait()
    assert eng.status()["straight"] == 2


@pytest.mark.skipif(not INTERPRET, reason="CPU pools need TRITON_INTERPRET=1")
def test_a_failing_direct_kernel_falls_back_to_the_ring_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``auto`` a direct kernel that fails (say Triton cannot reach host memory) is
    replaced by the ring, with a warning, for this transfer and the later ones; bytes right."""
    from hicache.backends import kernels

    l1, l2 = pools()
    eng = TransferEngine(l1, l2, "auto", direct_max_bytes=1 << 30, chunk_bytes=2 * l1.geometry.bytes_per_page)
    real = kernels.gather_triton

    def no_host(slabs: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor, packed_ids: Any = None) -> None:
        if packed_ids is not None:
            raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")
        real(slabs, ids, packed)

    monkeypatch.setattr(kernels, "gather_triton", no_host)
    eng.direct_usable = True  # as under auto on CUDA (on CPU only an explicit "triton" goes direct)
    want = l1_rows(l1, [3, 4, 5])
    with pytest.warns(RuntimeWarning, match="direct transfer failed"):
        assert eng.d2h([3, 4, 5], [9, 1, 7]).wait()
    assert torch.equal(l2.slabs[[9, 1, 7]], want)
    assert not eng.direct_usable and eng.status()["paths"] == {"copy": 0, "direct": 0, "ring": 1, "layered": 0}
    round_trip(eng, 5, fragmented=True, seed=2)


class Upload:
    """Stands for a transfer's end event in the index ring: done or not, and waited for."""

    def __init__(self, done: bool) -> None:
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def test_the_index_ring_reuses_a_region_only_once_its_upload_ended() -> None:
    """Regions go round the ring, each list at an even index; taking one waits for exactly
    the regions still in flight that it overlaps, and forgets finished ones."""
    from hicache.backends.transfer import _Ids

    ids = _Ids(16, torch.device("cpu"), cuda=False)
    ids.cuda = True  # the reuse rule is the CUDA one; the buffers stay on the CPU
    a, b, c = Upload(False), Upload(False), Upload(False)
    assert ids.put([1, 2, 3], [4, 5, 6]) == (0, 8)  # two lists of 3, each padded to 4
    assert ids.np[:7].tolist() == [1, 2, 3, ids.np[3], 4, 5, 6]
    ids.live.append((0, 8, a))
    assert ids.put([7, 8, 9]) == (8, 4)
    ids.live.append((8, 12, b))
    assert ids.put([1, 2]) == (12, 2)
    ids.live.append((12, 14, c))
    start, _ = ids.put([5, 6, 7])  # does not fit before the end: wraps, overlapping a only
    assert start == 0 and a.waited and not b.waited and not c.waited
    assert [r[2] for r in ids.live] == [b, c]
    b.done = True
    ids.put([1])  # [4, 6): nothing overlapped; b has finished and is dropped, c is not
    assert [r[2] for r in ids.live] == [c] and not c.waited


def _straight_cases(cap: int, pages: int) -> dict[str, tuple[list[int], list[int], bool]]:
    """(L2 pages, L1 pages, goes straight) at the straight path's page cap."""
    head = cap - 56
    return {
        "cap, one run": (list(range(100, 100 + cap)), list(range(300, 300 + cap)), True),
        "cap, two runs, L1 ending at the last page": (
            list(range(head)) + list(range(400, 456)),
            list(range(10, 10 + head)) + list(range(pages - 56, pages)),
            True,
        ),
        "cap, two runs, L2 ending at the last page": (
            list(range(pages - head, pages)) + list(range(56)),
            list(range(head)) + list(range(300, 356)),
            True,
        ),
        "cap + 1, one run: the ring": (list(range(cap + 1)), list(range(200, 201 + cap)), False),
        "cap, three runs: the ring": (
            list(range(100)) + list(range(200, 300)) + list(range(400, 400 + cap - 200)),
            list(range(100)) + list(range(150, 250)) + list(range(300, 300 + cap - 200)),
            False,
        ),
    }


@pytest.mark.parametrize("case", sorted(_straight_cases(STRAIGHT_MAX_PAGES, 600)))
def test_the_default_straight_cap_lands_every_page_and_signals_every_layer(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Without row DMAs (``d2d_runs=0``; with them the straight path is the fallback) an
    engine copies up to ``STRAIGHT_MAX_PAGES`` pages (256, as the docs say) in at most 2
    runs straight into L1, one page more or one run more through the ring; either
    way every page lands bit-exact, nothing else in L1 or L2 changes, and each layer's event
    is recorded once its group of layers (and no later one) has landed."""
    assert STRAIGHT_MAX_PAGES == 256, "docs/DESIGN.md and docs/RESULTS.md give the cap as 256"
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    pages = 600
    l1, l2 = pools(pages, layers=5, seed=9)
    eng = engine(l1, l2, 16, 2, layer_group=1, max_layer_group=4, d2d_runs=0)
    src, dst, straight = _straight_cases(STRAIGHT_MAX_PAGES, pages)[case]
    assert layered_h2d_exactly(eng, l1, l2, src, dst)["straight"] == int(straight)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "4"])
def test_ring_head_pages_must_be_an_int_of_at_least_zero(bad: object) -> None:
    l1, l2 = pools()
    with pytest.raises(ConfigError, match="ring_head_pages must be an int >= 0"):
        engine(l1, l2, 2, 2, ring_head_pages=bad)
