"""Stream order of the transfer engine on CUDA, with tests that fail when a wait is missing.

Every stream is warm before the scene (the engine's ring and index buffers allocated, the
caller's and the engine's streams used, every tensor of the scene allocated): a fresh
stream's first allocation synchronizes and would hide a missing wait. Each scene queues a
long kernel (``torch.cuda._sleep``) where a missing wait would let the other side run first.

Each test has, per wait it relies on, a ``without-<wait>`` variant that removes that wait
and asserts the data IS stale (so the test is shown able to fail). They are skipped unless
``HICACHE_PROVE_WAITS=1``::

    HICACHE_PROVE_WAITS=1 python -m pytest -q -m gpu tests/gpu/test_streams_gpu.py -k without

Every ``without-*`` case must pass (stale seen); every ``with-wait`` case must pass too.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from hicache.backends import dma
from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.transfer import DeviceTicket, TransferBackend, TransferEngine
from hicache.core.geometry import KVGeometry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time
PROVE = os.environ.get("HICACHE_PROVE_WAITS") == "1"
G = KVGeometry(4, 2, 64, 16, torch.bfloat16)  # 32 KiB pages
PATHS = {  # engine keyword arguments per path; "multi": 4 chunks of 2 pages for 8 pages
    "copy": {"copy_max_pages": 1 << 30},
    "direct": {"copy_max_pages": 0, "direct_max_bytes": 1 << 30},
    "ring": {"copy_max_pages": 0, "direct_max_bytes": 0, "chunk_bytes": 64 * G.bytes_per_page},
    "multi": {"copy_max_pages": 0, "direct_max_bytes": 0, "chunk_bytes": 2 * G.bytes_per_page, "chunks": 2},
    "split": {
        "copy_max_pages": 0,
        "direct_max_bytes": 0,
        "chunk_bytes": 2 * G.bytes_per_page,
        "chunks": 2,
        "split_layered": True,
        "straight_runs": 0,  # the ring, whatever the page runs
        "d2d_runs": 0,  # and the scatter kernel out of its slots
    },
    "rows": {  # the split's streams, slots into L1 by row DMAs on the copy engine
        "copy_max_pages": 0,
        "direct_max_bytes": 0,
        "chunk_bytes": 2 * G.bytes_per_page,
        "chunks": 2,
        "straight_runs": 0,
        "d2d_min_bytes": 0,
    },
}


def variants(*waits: str) -> list[Any]:
    """The normal case, and one per wait with that wait removed (run on purpose only)."""
    off = pytest.mark.skipif(not PROVE, reason="set HICACHE_PROVE_WAITS=1 to show the wait is needed")
    return [pytest.param(None, id="with-wait")] + [pytest.param(w, id=f"without-{w}", marks=off) for w in waits]


def drop(monkeypatch: pytest.MonkeyPatch, wait: str | None) -> None:
    """Remove one wait: an engine hook (``TransferEngine._wait_*``) or the caller's
    ``DeviceTicket.wait_on_current_stream``."""
    if wait == "wait_on_current_stream":
        monkeypatch.setattr(DeviceTicket, "wait_on_current_stream", lambda self: None)
    elif wait is not None:
        monkeypatch.setattr(TransferEngine, f"_{wait}", lambda self, *args: None)


def judge(fresh: bool, wait: str | None) -> None:
    if wait is None:
        assert fresh, "stale pages with every wait in place"
    else:
        assert not fresh, f"without {wait} the pages were still right: this scene cannot catch its absence"


def slow(engine: TransferEngine, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """Queue a long kernel on the current stream before each of the engine's DMAs
    (``what="dma"``) or gathers/scatters (``"kernel"``), or a layered H2D's DMAs
    (``"layer_dma"``) or the moves out of its slots (``"layer_kernel"``: scatters or row
    DMAs), so that side runs late."""
    name = {"dma": "_dma_runs", "kernel": "_run", "layer_dma": "_layer_dmas", "layer_kernel": "_unpack"}[what]
    real = getattr(engine, name)

    def late(*args: Any) -> None:
        # NOTE: the sleep goes on the stream the work queues on, which DMAs name rather than
        # take from the current stream: _unpack is handed its stream, the L2 DMAs go on the
        # transfer stream (a ring queues them while its kernel stream is current)
        if what == "layer_kernel" and args[-1] is not None:
            stream = args[-1]
        elif what in ("dma", "layer_dma"):
            stream = engine.stream
        else:
            stream = torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES // 4)  # type: ignore[no-untyped-call]
        real(*args)

    monkeypatch.setattr(engine, name, late)


class Scene:
    """Pools, an engine on ``path``, and a caller stream, all warm."""

    def __init__(self, backend: TransferBackend, path: str, pages: int = 8) -> None:
        self.l1 = DevicePool.allocate(G, 64, "cuda")
        self.l1.buffer.copy_(torch.randn(self.l1.buffer.shape, device="cuda").to(G.dtype))
        self.l2 = HostPool(G, 64)
        self.l2.page_buffer.copy_(torch.randn(self.l2.page_buffer.shape).to(G.dtype))
        # NOTE: groups 1, 2, 1 of the 4 layers, whatever the defaults: the scenes below (which
        # unit refills which slot) are written for them
        groups = {"layer_group": 1, "max_layer_group": 3, "last_layer_group": 1}
        self.engine = TransferEngine(self.l1, self.l2, backend, min_run_bytes=0, **groups, **PATHS[path])  # type: ignore[arg-type]
        self.pages = pages
        self.caller: Any = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.fresh = torch.randn(self.l1.buffer[:, :, :pages].shape, device="cuda").to(G.dtype)
        self.snapshot = torch.empty_like(self.l1.buffer[:, :, :pages])
        with torch.cuda.stream(self.caller):
            for _ in range(2):  # same sizes and paths as the scenes: every cache warm
                self.snapshot.copy_(self.l1.buffer[:, :, 40 : 40 + pages])
                assert self.engine.d2h(list(range(40, 40 + pages)), list(range(40, 40 + pages))).wait()
                assert self.engine.h2d(list(range(40, 40 + pages)), list(range(40, 40 + pages))).wait()
                torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()

    @property
    def span(self) -> slice:
        return slice(8, 8 + self.pages)

    def ids(self) -> list[int]:
        return list(range(self.span.start, self.span.stop))

    def fresh_d2h(self) -> bool:
        """The caller writes ``fresh`` into the span behind a long kernel and asks for its
        D2H at once; whether L2 then holds ``fresh``."""
        with torch.cuda.stream(self.caller):
            torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
            self.l1.buffer[:, :, self.span].copy_(self.fresh)
            ticket = self.engine.d2h(self.ids(), list(range(self.pages)))
        assert ticket.wait()
        torch.cuda.synchronize()
        return torch.equal(self.l2.buffer[:, :, : self.pages], self.fresh.cpu())


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("path", ["copy", "direct", "ring", "multi"])
@pytest.mark.parametrize("wait", variants("wait_caller", "wait_join"))
def test_d2h_reads_the_pages_the_caller_just_wrote(
    monkeypatch: pytest.MonkeyPatch, backend: TransferBackend, path: str, wait: str | None
) -> None:
    """The caller writes L1 pages behind a long kernel and asks for their D2H at once:
    the transfer (and, across chunks, its kernel stream) must wait for those writes."""
    if backend == "torch" and path == "direct":
        pytest.skip("the direct path is Triton's")
    if wait == "wait_join" and path != "multi":
        pytest.skip("only a multi-chunk transfer uses the kernel stream")
    s = Scene(backend, path)
    drop(monkeypatch, wait)
    judge(s.fresh_d2h(), wait)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("path", ["ring", "multi"])
def test_without_cuda_python_the_ring_reads_this_transfers_page_ids(
    monkeypatch: pytest.MonkeyPatch, backend: TransferBackend, path: str
) -> None:
    """Without cuda-python the page ids go up by torch's copy. It must be queued on the
    transfer stream, like the kernels that read them: queued on the caller's (here busy
    with a long kernel queued after the transfer's wait on it), the gather read the ids an
    earlier transfer left there, and other pages went to L2."""
    monkeypatch.setattr(dma, "AVAILABLE", False)
    s = Scene(backend, path)
    assert not s.engine.copy_usable and s.engine._ids is not None
    upload = s.engine._ids.upload

    def late(*args: Any) -> Any:  # the caller's stream stays busy after the transfer's wait on it
        torch.cuda._sleep(SLEEP_CYCLES // 4)  # type: ignore[no-untyped-call]
        return upload(*args)

    monkeypatch.setattr(s.engine._ids, "upload", late)
    assert s.fresh_d2h()
    assert s.engine.paths["ring"] >= 3


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("path", ["copy", "direct", "ring", "multi", "layered", "scatter", "straight"])
@pytest.mark.parametrize("wait", variants("wait_caller"))
def test_h2d_does_not_overwrite_pages_the_caller_still_reads(
    monkeypatch: pytest.MonkeyPatch, backend: TransferBackend, path: str, wait: str | None
) -> None:
    """The caller still reads L1 pages (behind a long kernel) when it asks to overwrite
    them by H2D: the read must see the old bytes (and the pages end as the new ones)."""
    if backend == "torch" and path == "direct":
        pytest.skip("the direct path is Triton's")
    layered = path in ("layered", "scatter", "straight")
    if layered and not dma.AVAILABLE:
        pytest.skip("the layered H2D needs cuda-python")
    s = Scene(backend, "ring" if layered else path)
    if path != "straight":
        s.engine.straight_runs = 0  # through the ring (the pages here are one run)
    if path != "layered":
        s.engine.d2d_runs = 0  # out of the slots by the scatter kernel (or straight)
    s.engine.d2d_min_bytes = 0
    events = [torch.cuda.Event() for _ in range(G.num_layers)] if layered else None  # type: ignore[no-untyped-call]
    if events is not None:  # warm the layered path too
        with torch.cuda.stream(s.caller):
            assert s.engine.h2d(list(range(40, 48)), list(range(40, 48)), layer_events=events).wait()
        torch.cuda.synchronize()
    old = s.l1.buffer[:, :, s.span].clone()
    torch.cuda.synchronize()
    drop(monkeypatch, wait)
    with torch.cuda.stream(s.caller):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        s.snapshot.copy_(s.l1.buffer[:, :, s.span])  # queued behind the sleep
        ticket = s.engine.h2d(list(range(20, 20 + s.pages)), s.ids(), layer_events=events)
        ticket.wait_on_current_stream()
    torch.cuda.synchronize()
    assert ticket.wait() and (not layered or s.engine.status()["paths"]["layered"] == 2)
    assert s.engine.status()["straight"] == (2 if path == "straight" else 0)
    assert s.engine.status()["d2d"] == (2 if path == "layered" else 0)
    assert torch.equal(s.l1.buffer[:, :, s.span].cpu(), s.l2.buffer[:, :, 20 : 20 + s.pages])
    judge(torch.equal(s.snapshot, old), wait)


@pytest.mark.parametrize("path", ["copy", "direct", "ring", "multi"])
@pytest.mark.parametrize("wait", variants("wait_on_current_stream"))
def test_the_caller_reads_restored_pages_only_after_they_landed(
    monkeypatch: pytest.MonkeyPatch, path: str, wait: str | None
) -> None:
    """The copy is held back on the transfer stream; a caller that waits on the ticket's
    event (no host block) then reads the pages sees the restored bytes."""
    s = Scene("triton", path)
    drop(monkeypatch, wait)
    with torch.cuda.stream(s.engine.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(s.caller):
        ticket = s.engine.h2d(list(range(20, 20 + s.pages)), s.ids())
        ticket.wait_on_current_stream()
        s.snapshot.copy_(s.l1.buffer[:, :, s.span])
    torch.cuda.synchronize()
    assert ticket.wait()
    judge(torch.equal(s.snapshot.cpu(), s.l2.buffer[:, :, 20 : 20 + s.pages]), wait)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("wait", variants("wait_ready"))
def test_each_chunk_is_consumed_only_after_it_was_produced(
    monkeypatch: pytest.MonkeyPatch, direction: str, wait: str | None
) -> None:
    """Across the two streams, a chunk's DMA waits for its gather (D2H) and its scatter
    for its DMA (H2D), and the ticket's event comes after the last scatter: the producer
    side is held back before each chunk, the ring zeroed first."""
    s = Scene("triton", "multi")
    assert s.engine._ring is not None
    s.engine._ring.memory.zero_()
    slow(s.engine, monkeypatch, "kernel" if direction == "d2h" else "dma")
    torch.cuda.synchronize()
    drop(monkeypatch, wait)
    with torch.cuda.stream(s.caller):
        if direction == "d2h":
            ticket = s.engine.d2h(s.ids(), list(range(s.pages)))
        else:
            ticket = s.engine.h2d(list(range(20, 20 + s.pages)), s.ids())
    assert ticket.wait()
    got = s.l2.buffer[:, :, : s.pages] if direction == "d2h" else s.l1.buffer[:, :, s.span].cpu()
    want = s.l1.buffer[:, :, s.span].cpu() if direction == "d2h" else s.l2.buffer[:, :, 20 : 20 + s.pages]
    fresh = torch.equal(got, want)
    torch.cuda.synchronize()
    judge(fresh, wait)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("wait", variants("wait_free"))
def test_a_ring_slot_is_reused_only_after_its_last_user(
    monkeypatch: pytest.MonkeyPatch, direction: str, wait: str | None
) -> None:
    """8 pages through 2 slots of 2: chunk 2 reuses chunk 0's slot. Its consumer (the
    DMA of a D2H, the scatter of an H2D) is held back; refilling the slot must wait."""
    s = Scene("triton", "multi")
    slow(s.engine, monkeypatch, "dma" if direction == "d2h" else "kernel")
    torch.cuda.synchronize()
    drop(monkeypatch, wait)
    with torch.cuda.stream(s.caller):
        if direction == "d2h":
            ticket = s.engine.d2h(s.ids(), list(range(s.pages)))
        else:
            ticket = s.engine.h2d(list(range(20, 20 + s.pages)), s.ids())
    assert ticket.wait()
    torch.cuda.synchronize()
    got = s.l2.buffer[:, :, : s.pages] if direction == "d2h" else s.l1.buffer[:, :, s.span].cpu()
    want = s.l1.buffer[:, :, s.span].cpu() if direction == "d2h" else s.l2.buffer[:, :, 20 : 20 + s.pages]
    judge(torch.equal(got, want), wait)


@pytest.mark.parametrize("layered", [False, True])
@pytest.mark.parametrize("wait", variants("wait_caller"))
def test_an_aborted_layered_prefills_pages_are_not_overwritten_by_their_next_h2d(
    monkeypatch: pytest.MonkeyPatch, layered: bool, wait: str | None
) -> None:
    """A request's layered prefill still runs on its own stream (it reads the request's
    pages, behind a long kernel) when the request is aborted and its pages are reused as
    an H2D destination. The abort joins the layered stream into the caller's (as
    ``ModelRunner.join_layered`` does); the H2D must then not overwrite the pages before
    the forward has read them."""
    if layered and not dma.AVAILABLE:
        pytest.skip("the layered H2D needs cuda-python")
    s = Scene("triton", "ring")
    side: Any = torch.cuda.Stream(priority=-1)  # type: ignore[no-untyped-call]
    events = [torch.cuda.Event() for _ in range(G.num_layers)] if layered else None  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        s.snapshot.copy_(s.l1.buffer[:, :, 40 : 40 + s.pages])  # warm the forward's stream
    with torch.cuda.stream(s.caller):
        assert s.engine.h2d(list(range(40, 48)), list(range(40, 48)), layer_events=events).wait()
    old = s.l1.buffer[:, :, s.span].clone()
    torch.cuda.synchronize()
    drop(monkeypatch, wait)
    with torch.cuda.stream(side):  # the layered forward, still queued
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        s.snapshot.copy_(s.l1.buffer[:, :, s.span])
    s.caller.wait_stream(side)  # the abort: ModelRunner.join_layered()
    with torch.cuda.stream(s.caller):
        ticket = s.engine.h2d(list(range(20, 20 + s.pages)), s.ids(), layer_events=events)
    assert ticket.wait()
    torch.cuda.synchronize()
    judge(torch.equal(s.snapshot, old), wait)


LAYERED_SCENES = [  # (scene, L2 layout, the waits it shows needed)
    ("late-caller", "fragmented", ("wait_join",)),
    ("late-dma", "consecutive", ("wait_ready",)),
    ("late-scatter", "consecutive", ("wait_free", "wait_done", "record_layer")),
]


@pytest.mark.parametrize(
    ("scene", "layout", "wait"),
    [
        pytest.param(scene, layout, w, id=f"{scene}-{p.id}", marks=p.marks)
        for scene, layout, waits in LAYERED_SCENES
        for p in variants(*waits)
        for w in p.values
    ],
)
@pytest.mark.parametrize("path", ["split", "rows"])
def test_a_split_layered_h2d_lands_every_layer_through_both_streams(
    monkeypatch: pytest.MonkeyPatch, scene: str, layout: str, wait: str | None, path: str
) -> None:
    """A layered H2D with ``split_layered`` (or out of its slots by row DMAs: ``rows``)
    runs its DMAs on the transfer stream and its scatters or row DMAs (from fragmented L2
    pages: zero-copy loads) and layer events on the kernel stream.
    8 pages through 2 ring slots of 2 pages: the 2-layer group takes two units, so
    the third unit refills slot 0. Each scene holds one side back, with every wait in place
    and with each wait it relies on removed:

    - late-caller (fragmented): the caller is slow; the loads start behind the transfer
      stream, which waits for the caller and uploads the page ids the loads read (wait_join);
    - late-dma: each unit's DMAs are held back (ring zeroed); a scatter waits for them
      (wait_ready);
    - late-scatter: each scatter is held back; refilling a slot waits for its scatter
      (wait_free), the ticket's event comes after the last one (wait_done: the pages are read
      as soon as the ticket says they landed), and a forward on another stream that waits on
      layer l's event reads layer l of every page landed (record_layer)."""
    if not dma.AVAILABLE:
        pytest.skip("the layered H2D needs cuda-python")
    if path == "rows" and layout == "fragmented" and wait == "wait_join":
        # NOTE: fragmented L2 pages are loaded in place, not moved out of slots by row DMAs:
        # without split_layered the loads run on the transfer stream, and nothing joins it
        pytest.skip("rows, fragmented: the loads run on the transfer stream (no kernel stream to join)")
    s = Scene("triton", path)
    layers = G.num_layers
    events = [torch.cuda.Event() for _ in range(layers)]  # type: ignore[no-untyped-call]
    src = list(range(20, 20 + s.pages)) if layout == "consecutive" else list(range(20, 20 + 2 * s.pages, 2))
    forward: Any = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    seen = torch.empty_like(s.l1.buffer[:, :, s.span])
    with torch.cuda.stream(s.caller):  # warm the layered path, both streams and both layouts
        for warm in (list(range(40, 48)), list(range(40, 56, 2))):
            assert s.engine.h2d(warm, list(range(40, 48)), layer_events=events).wait()
    with torch.cuda.stream(forward):
        seen.copy_(s.l1.buffer[:, :, s.span])
    assert s.engine._ring is not None
    s.engine._ring.memory.zero_()
    torch.cuda.synchronize()
    if scene == "late-dma":
        slow(s.engine, monkeypatch, "layer_dma")
    elif scene == "late-scatter":
        slow(s.engine, monkeypatch, "layer_kernel")
    drop(monkeypatch, wait)
    with torch.cuda.stream(s.caller):
        if scene == "late-caller":
            torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        ticket = s.engine.h2d(src, s.ids(), layer_events=events)
    with torch.cuda.stream(forward):  # a layered forward: layer l after its event only
        for layer in range(layers):
            forward.wait_event(events[layer])
            seen[:, layer].copy_(s.l1.buffer[:, layer, s.span])
    assert ticket.wait()
    got = s.l1.buffer[:, :, s.span].cpu()  # at once: only the ticket's event orders this read
    torch.cuda.synchronize()
    assert s.engine.status()["paths"]["layered"] == 3
    assert s.engine.status()["d2d"] == (0 if path == "split" else 1 + (layout == "consecutive"))
    want = s.l2.buffer[:, :, src]
    if wait == "record_layer":
        judge(torch.equal(seen.cpu(), want), wait)
    else:
        judge(torch.equal(got, want) and torch.equal(seen.cpu(), want), wait)
