"""The layer-pipelined restore on CUDA: its mechanism (a CUDA graph waits on external events
recorded outside it, on another stream, after capture; strided DMAs), the layered H2D, and
the engine's layered prefill against the L1 hit (bit-identical)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from hicache.backends import dma
from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.transfer import TransferBackend, TransferEngine
from hicache.core.geometry import KVGeometry
from hicache.engine import Engine, Output
from hicache.errors import ConfigError
from hicache.spec.model import Tier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU time on the producer stream


def hold_back_h2d(e: Engine) -> None:
    """Every H2D of ``e`` starts ~50 ms late on its stream (the host is not held)."""
    h2d = e.cache.device.h2d

    def late(src: list[int], dst: list[int], layer_events: object = None) -> object:
        with torch.cuda.stream(e.cache.device.stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        return h2d(src, dst, layer_events=layer_events)  # type: ignore[arg-type]

    e.cache.device.h2d = late  # type: ignore[method-assign, assignment]


def drop_l1(e: Engine, *, garbage: bool) -> None:
    """Every page of ``e``'s tree leaves L1 (its L2 copy stays); ``garbage`` then fills the
    L1 pool with noise, so a forward that read a page before it landed gives other logits."""
    e.cache.drain()
    e.cache.core.evict(Tier.L1, 10**6)
    if garbage:
        e.cache.l1.buffer.normal_()


def assert_served_like_the_hit(e: Engine, out: Output, hit: Output, layered_used: int) -> None:
    """``out`` was restored from L2 through ``e``'s layered prefill (the ``layered_used``-th)
    and gave exactly the L1 hit's logits and tokens."""
    assert out.restored_from == "L2" and e.stats.layered_used == layered_used
    assert out.first_logits is not None and hit.first_logits is not None
    assert torch.equal(out.first_logits, hit.first_logits) and out.tokens == hit.tokens


def test_graph_waits_on_external_event_recorded_after_capture() -> None:
    x = torch.zeros(1024, device="cuda")
    out = torch.zeros(1024, device="cuda")
    ready = torch.cuda.Event(external=True)  # type: ignore[no-untyped-call]
    producer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    ready.record(producer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ready.wait(torch.cuda.current_stream())
        out.copy_(x * 2)
    torch.cuda.synchronize()
    for value in (3.0, 5.0):  # replayed twice: each replay waits for that round's record
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
            x.fill_(value)
            ready.record(producer)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(out, 2 * value))


@pytest.mark.skipif(not dma.AVAILABLE, reason="needs cuda-python")
def test_copy_rows_copies_strided_host_rows() -> None:
    src = torch.randn(7, 6, 33).pin_memory()
    dst = torch.zeros(7, 6, 33, device="cuda")
    stream = torch.cuda.current_stream()
    dma.copy_rows(dst[:, 2:4].flatten(1), src[:, 2:4].flatten(1), stream)
    torch.cuda.synchronize()
    want = torch.zeros(7, 6, 33)
    want[:, 2:4] = src[:, 2:4]
    assert torch.equal(dst.cpu(), want)


@pytest.mark.skipif(not dma.AVAILABLE, reason="needs cuda-python")
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("l2_pages", [list(range(20, 25)), [30, 2, 17, 18, 5]])
@pytest.mark.parametrize("l1_pages", [[6, 1, 9, 10, 3], [40, 41, 42, 43, 44]], ids=["l1-scattered", "l1-run"])
def test_layered_h2d_lands_every_page_and_signals_every_layer(
    backend: TransferBackend, l2_pages: list[int], l1_pages: list[int]
) -> None:
    """Through the ring: out of its slots by row DMAs when L1 is one run (``d2d``), else by
    the scatter kernel; straight into L1 only where the ring cannot be had."""
    g = KVGeometry(5, 2, 64, 16, torch.bfloat16)
    dev = DevicePool.allocate(g, 64, "cuda")
    host = HostPool(g, 64)
    host.page_buffer.copy_(torch.randn(host.page_buffer.shape).to(g.dtype))
    engine = TransferEngine(dev, host, backend, layer_group=2, scatter_programs=3, d2d_min_bytes=0)
    events: list[Any] = [torch.cuda.Event() for _ in range(g.num_layers)]  # type: ignore[no-untyped-call]
    engine.h2d(l2_pages, l1_pages, layer_events=events).wait()  # allocations (they synchronize) first
    with torch.cuda.stream(engine.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]  # the copy starts late
    ticket = engine.h2d(l2_pages, l1_pages, layer_events=events)
    assert not events[0].query()  # recorded behind the copy, not at once
    assert ticket.wait()
    assert all(e.query() for e in events)
    got = dev.slabs.index_select(1, torch.tensor(l1_pages, device="cuda")).transpose(0, 1).cpu()
    assert torch.equal(got, host.slabs[l2_pages])
    # fragmented L2 pages: zero-copy loads instead (Triton's), no slots
    rows = l1_pages[0] == 40 and (l2_pages[0] == 20 or backend == "torch")
    assert engine.status()["d2d"] == (2 if rows else 0) and engine.status()["straight"] == 0
    with pytest.raises(ConfigError, match="events for 5 layers"):
        engine.h2d([0], [0], layer_events=events[:2])


@pytest.mark.skipif(not dma.AVAILABLE, reason="needs cuda-python")
def test_layered_h2d_falls_back_to_torch_when_the_triton_scatter_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    g = KVGeometry(4, 2, 64, 16, torch.bfloat16)
    dev = DevicePool.allocate(g, 32, "cuda")
    host = HostPool(g, 32)
    host.page_buffer.copy_(torch.randn(host.page_buffer.shape).to(g.dtype))
    engine = TransferEngine(dev, host, "auto", copy_max_pages=0)  # the staged path: it scatters
    engine.h2d([0], [0]).wait()  # autotune first: it picks the Triton scatter here

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel")

    monkeypatch.setattr("hicache.backends.kernels.load_layers_triton", broken)
    engine.scatter_backend = "triton"
    engine.direct_usable = False  # not the zero-copy load: the scatter after the DMAs
    events: list[Any] = [torch.cuda.Event() for _ in range(g.num_layers)]  # type: ignore[no-untyped-call]
    with pytest.warns(RuntimeWarning, match="falling back to torch"):
        assert engine.h2d([3, 4, 9], [7, 2, 5], layer_events=events).wait()
    assert engine.scatter_backend == "torch"
    got = dev.slabs.index_select(1, torch.tensor([7, 2, 5], device="cuda")).transpose(0, 1).cpu()
    assert torch.equal(got, host.slabs[[3, 4, 9]])


@pytest.mark.skipif(not dma.AVAILABLE, reason="needs cuda-python")
@pytest.mark.parametrize("signals", [True, False], ids=["value-waits", "events"])
@pytest.mark.parametrize("graphs", [False, True])
def test_layered_restore_waits_for_each_layer_and_matches_the_l1_hit(
    monkeypatch: pytest.MonkeyPatch, graphs: bool, signals: bool
) -> None:
    """The copy is held back ~50 ms and L1 is filled with garbage first: a forward that
    read a layer before it landed would give other logits. With value waits the forward is
    launched before the copies are queued, and every round leaves the flags at zero."""
    monkeypatch.setattr("hicache.engine.model.LAYER_SIGNALS", signals)
    # the tiny model's 2 layers are 2 groups: a replay is launched once the first is queued
    monkeypatch.setattr("hicache.engine.engine.FORWARD_AFTER_GROUPS", 1)
    e = Engine(
        "tiny",
        device="cuda",
        page_size=16,
        num_pages=256,
        enable_hicache=True,
        l2_pages=256,
        policy="always",
        cuda_graphs=graphs,
        layered_restore=True,
    )
    rng = random.Random(0)
    prompt = [rng.randrange(512) for _ in range(300)]
    e.generate(prompt)
    e.cache.drain()
    hit = e.generate([*prompt, 5, 6], max_new_tokens=4)
    assert (e.runner.signals is not None) == signals
    order = launch_order(e, monkeypatch)
    hold_back_h2d(e)
    for round in (1, 2):  # the second replays the layered graph captured by the first
        drop_l1(e, garbage=True)
        out = e.generate([*prompt, 5, 6], max_new_tokens=4)
        assert_served_like_the_hit(e, out, hit, round)
    # value waits: a replay is launched while its copies are being queued (a first use
    # captures, which synchronizes the device: after them); events: always after them
    assert order == ["copies", "forward"] + (["forward", "copies"] if signals and graphs else ["copies", "forward"])
    flags_back_at_zero(e)
    e.cache.check_integrity()
    e.close()


def launch_order(e: Engine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Logs, per layered restore, whether its forward was launched or its copies were all
    queued first."""
    order: list[str] = []
    forward = e.runner.forward

    def fwd(seqs: Any, *, layered: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
        if layered:
            order.append("forward")
        return forward(seqs, layered=layered, into=into)

    straight, ring = e.cache.device._issue_straight, e.cache.device._issue

    def copies(*args: Any) -> Any:  # straight into L1: layered H2Ds only
        out = straight(*args)
        order.append("copies")
        return out

    def through_the_ring(*args: Any) -> Any:  # (ticket, path, d2h, l1, l2, runs, events, l1_runs)
        out = ring(*args)
        if args[6] is not None:
            order.append("copies")
        return out

    monkeypatch.setattr(e.runner, "forward", fwd)
    monkeypatch.setattr(e.cache.device, "_issue_straight", copies)
    monkeypatch.setattr(e.cache.device, "_issue", through_the_ring)
    return order


def flags_back_at_zero(e: Engine) -> None:
    """Every round of layer signals was consumed: the flags are zero again."""
    torch.cuda.synchronize()
    if e.runner.signals is not None:
        assert int(e.runner.signals.flags.abs().sum()) == 0, e.runner.signals.flags.tolist()
        assert e.runner.signals.ignored == 0


@pytest.mark.skipif(not dma.AVAILABLE, reason="needs cuda-python")
@pytest.mark.parametrize("failure", ["read-fault", "no-room", "forward-raises", "cannot-queue"])
def test_a_failed_signalled_restore_consumes_its_round_and_the_next_is_exact(
    monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Each way a signalled restore can fail on the GPU: no hang (every signal written, each
    round consumed), the request served or failed as the CPU tests say, the flags zero,
    and the next restore (held back, over garbage) gives the L1 hit's logits exactly."""
    monkeypatch.setattr("hicache.engine.model.LAYER_SIGNALS", True)
    e = Engine("tiny", device="cuda", page_size=16, num_pages=256, enable_hicache=True, l2_pages=256,
               policy="always", layered_restore=True)  # fmt: skip
    assert e.runner.signals is not None
    rng = random.Random(5)
    prompt = [rng.randrange(512) for _ in range(300)]
    e.generate(prompt)
    e.cache.drain()
    hit = e.generate([*prompt, 5, 6], max_new_tokens=4)
    undo: list[Any] = []
    if failure == "read-fault":
        e.cache.faults.add("fail", op="read")
    elif failure == "no-room":
        allocate = e.cache.allocate
        calls = {"n": 0}

        def no_room_once(req: Any, n: int) -> Any:
            calls["n"] += 1
            return None if calls["n"] == 1 else allocate(req, n)

        monkeypatch.setattr(e.cache, "allocate", no_room_once)
    elif failure == "forward-raises":
        forward = e.runner._forward

        def oom(seqs: Any, layered: bool, into: torch.Tensor | None = None) -> torch.Tensor:
            if layered:
                raise torch.OutOfMemoryError("no memory for the layered forward")
            return forward(seqs, layered, into)

        monkeypatch.setattr(e.runner, "_forward", oom)
        undo.append(lambda: monkeypatch.setattr(e.runner, "_forward", forward))
    else:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("cudaMemcpy2DAsync failed")

        real = e.cache.device._issue_straight
        monkeypatch.setattr(e.cache.device, "_issue_straight", broken)
        undo.append(lambda: monkeypatch.setattr(e.cache.device, "_issue_straight", real))
    hold_back_h2d(e)
    drop_l1(e, garbage=True)
    rid = e.submit([*prompt, 5, 6], 4)
    (out,) = e.run()
    assert out.id == rid
    if failure == "forward-raises":
        assert out.error is not None
    elif failure == "no-room":  # restored, then prefilled over the restored prefix as usual
        assert out.error is None and out.restored_from == "L2" and out.first_logits is not None
        assert hit.first_logits is not None and torch.equal(out.first_logits, hit.first_logits)
    else:  # the restore failed: the whole prompt is recomputed
        assert out.error is None and out.restore_failed
    assert e.stats.layered_used == 0
    flags_back_at_zero(e)
    for fn in undo:
        fn()
    e.cache.drain()
    drop_l1(e, garbage=True)
    out = e.generate([*prompt, 5, 6], max_new_tokens=4)
    assert_served_like_the_hit(e, out, hit, 1)
    flags_back_at_zero(e)
    e.cache.check_integrity()
    e.close()


@pytest.mark.skipif(not dma.AVAILABLE, reason="needs cuda-python")
def test_an_eager_layered_prefill_keeps_its_inputs_while_another_prefill_runs() -> None:
    """A restored prompt with a 100-token tail prefills eagerly on the layered stream while
    its (held back) copy lands; a fresh prompt prefilled meanwhile on the caller's stream
    must not overwrite the layered forward's inputs: its logits equal the L1 hit's."""
    rng = random.Random(7)
    prefix = [rng.randrange(512) for _ in range(288)]  # 18 full pages
    prompt = prefix + [rng.randrange(512) for _ in range(100)]
    other = [rng.randrange(512) for _ in range(200)]

    def engine() -> Engine:
        return Engine("tiny", device="cuda", page_size=16, num_pages=256, enable_hicache=True, l2_pages=256,
                      policy="always", max_batch=4, layered_restore=True)  # fmt: skip

    ref = engine()
    ref.generate(prefix)
    hit = ref.generate(prompt, max_new_tokens=2)
    assert hit.cached_tokens == 288 and hit.restored_from == "L1"
    ref.close()

    e = engine()
    e.generate(prefix)
    drop_l1(e, garbage=True)
    hold_back_h2d(e)
    rid = e.submit(prompt, 2)
    e.submit(other, 2)  # admitted in the same step; its prefill runs while the restore lands
    outs = {o.id: o for o in e.run()}
    assert_served_like_the_hit(e, outs[rid], hit, 1)
    e.cache.check_integrity()
    e.close()


@pytest.mark.skipif(not dma.AVAILABLE, reason="needs cuda-python")
def test_a_layered_restore_beside_decoding_changes_no_output() -> None:
    """The scene that hangs when two streams replay graphs captured on one (Qwen3-8B
    shapes): requests decode on the caller's stream while a layered restore's prefill runs
    on its own. With the copy held back ~50 ms, the decoders' tokens and the restored
    request's logits must equal those of the same run with the layered restore off (the
    restored request takes one token, so every decode batch has the same rows in both runs)."""
    rng = random.Random(11)
    prefix = [rng.randrange(512) for _ in range(288)]
    decoders = [[rng.randrange(512) for _ in range(40)] for _ in range(3)]

    def run(layered: bool) -> tuple[list[list[int]], torch.Tensor, int]:
        e = Engine("tiny", device="cuda", page_size=16, num_pages=256, enable_hicache=True, l2_pages=256,
                   policy="always", max_batch=8, layered_restore=layered)  # fmt: skip
        e.generate(prefix)
        drop_l1(e, garbage=False)
        e.generate([*prefix, 1, 2, 3])  # the restore's graph is captured now (a capture waits for the GPU)
        drop_l1(e, garbage=False)  # the decoders' pages come next: no noise
        ids = [e.submit(p, 24) for p in decoders]
        while e.stats.decode_batches < 2:  # all three prefilled and decoding
            e.step()
        hold_back_h2d(e)
        rid = e.submit([*prefix, 1, 2, 3], 1)
        outs = {o.id: o for o in e.run()}
        e.cache.check_integrity()
        got = outs[rid]
        assert got.restored_from == "L2" and got.first_logits is not None
        assert e.stats.decode_s_while_restoring > 0  # decode ran while the restore landed
        used = e.stats.layered_used
        e.close()
        return [outs[i].tokens for i in ids], got.first_logits, used

    on_tokens, on_logits, used = run(True)
    off_tokens, off_logits, _ = run(False)
    assert used == 2
    assert on_tokens == off_tokens
    assert torch.equal(on_logits, off_logits)


@pytest.mark.skipif(not dma.AVAILABLE, reason="needs cuda-python")
def test_graphs_are_captured_on_the_runners_own_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch keys the cuBLAS workspace by the stream a graph is captured on: a layered graph
    and a decode graph captured on one stream and replayed at once would share it. The
    layered graphs are captured on the runner's side stream, the others on its capture
    stream; both are the runner's own (not another open runner's, nor any stream torch's
    pool hands out), and :meth:`Engine.close` hands them on to the next runner."""
    captured: list[tuple[int, bool]] = []  # (stream, layered)
    real = torch.cuda.graph

    def spy(graph: Any, pool: Any = None, stream: Any = None, **kwargs: Any) -> Any:
        assert stream is not None, "captured on torch's default capture stream"
        captured.append((stream.cuda_stream, torch.cuda.current_stream().cuda_stream == side))
        return real(graph, pool=pool, stream=stream, **kwargs)

    def make() -> Engine:
        return Engine("tiny", device="cuda", page_size=16, num_pages=256, enable_hicache=True, l2_pages=256,
                      policy="always", layered_restore=True)  # fmt: skip

    engines = [make(), make()]
    e = engines[0]
    side, capture = e.runner._side.cuda_stream, e.runner._capture_stream.cuda_stream
    mine = [s.cuda_stream for x in engines for s in (x.runner._side, x.runner._capture_stream)]
    pooled = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(40)}  # type: ignore[no-untyped-call]
    assert len(set(mine)) == 4 and not set(mine) & pooled
    monkeypatch.setattr(torch.cuda, "graph", spy)
    rng = random.Random(5)
    prompt = [rng.randrange(512) for _ in range(100)]
    e.generate(prompt, max_new_tokens=3)  # decode graphs
    drop_l1(e, garbage=False)
    out = e.generate([*prompt, 7], max_new_tokens=1)  # a layered graph
    assert out.restored_from == "L2" and e.stats.layered_used == 1
    assert {s for s, layered in captured if layered} == {side}
    assert {s for s, layered in captured if not layered} == {capture}
    engines[1].close()  # its streams go to the next runner, none to a runner still open
    third = make()
    assert {third.runner._side.cuda_stream, third.runner._capture_stream.cuda_stream} == set(mine[2:])
    for x in (e, third):
        x.close()


@pytest.mark.skipif(not dma.AVAILABLE, reason="needs cuda-python")
def test_every_path_of_row_copies_lands_its_pages() -> None:
    """Straight into L1, by row DMAs out of the ring, and the copy path's per-page DMAs
    both ways: the pages land bit-exact (random bits, so a misplaced row shows)."""
    g = KVGeometry(5, 2, 64, 16, torch.bfloat16)
    dev = DevicePool.allocate(g, 64, "cuda")
    host = HostPool(g, 64)
    host.page_buffer.view(torch.int16).random_(-(2**15), 2**15 - 1)
    events: list[Any] = [torch.cuda.Event() for _ in range(g.num_layers)]  # type: ignore[no-untyped-call]
    src, dst = list(range(20, 26)), list(range(40, 46))
    for kw, path in (({"d2d_runs": 0}, "straight"), ({"d2d_min_bytes": 0}, "d2d")):
        engine = TransferEngine(dev, host, "auto", **kw)  # type: ignore[arg-type]
        dev.buffer.zero_()
        assert engine.h2d(src, dst, layer_events=events).wait()
        got = dev.slabs[:, dst].transpose(0, 1).cpu()
        assert torch.equal(got.view(torch.int16), host.slabs[src].view(torch.int16)), path
        assert engine.status()[path] == 1, path
    copy = TransferEngine(dev, host, "auto", copy_max_pages=1 << 30)
    dev.buffer.view(torch.int16).random_(-(2**15), 2**15 - 1)
    assert copy.d2h([1, 7, 3], [50, 51, 60]).wait()
    got = dev.slabs[:, [1, 7, 3]].transpose(0, 1).cpu()
    assert torch.equal(got.view(torch.int16), host.slabs[[50, 51, 60]].view(torch.int16))
    assert copy.h2d([60, 50], [9, 2]).wait()
    got = dev.slabs[:, [9, 2]].transpose(0, 1).cpu()
    assert torch.equal(got.view(torch.int16), host.slabs[[60, 50]].view(torch.int16))
    assert copy.status()["paths"]["copy"] == 2
