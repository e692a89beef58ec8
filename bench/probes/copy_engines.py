"""Probe: do a layered H2D's 32 KiB rows keep their rate beside a forward when spread over
more copy queues, and does the ring's batched DMA call stay batched?

Qwen3-8B KV geometry, on CUDA, each figure against a plain pinned copy of the same bytes
measured in the same run:

1. the straight layered H2D's DMAs (one strided DMA per layer and K/V, rows of one layer of
   a page, 32 KiB) into a device buffer, alone and beside a matmul loop on another stream
   (the stand-in forward of ``layered_rate.py``), on 1 to 4 streams (layer ``i`` on stream
   ``i % k``), and with wider rows (2, 4, 8 layers) on one stream;
2. wide H2D rows per layer group into a staging buffer, then device-to-device row DMAs
   into L1 (the engine's layered H2D by row DMAs, done by hand), and the engine's ring;
3. the ring's D2H/H2D of 64 and 256 fragmented L2 pages (a batched DMA call per chunk):
   device service and wall time, and whether the batched call is still in use after them;
4. ``--profile N``: the N functions with the most own host time in 20 enqueues of the
   engine's layered H2D, by row DMAs and straight (``--only-profile``: this section alone).

    python bench/probes/copy_engines.py --pages 219
"""

# ruff: noqa: B023  (every closure below is called before its loop moves on)
from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the transfer bench's geometry
from transfer import QWEN3_8B, device_span, probe_parser, random_pools

from hicache.backends import dma
from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.transfer import TransferEngine, layer_groups


def profile(l1: DevicePool, l2: HostPool, n: int, top: int) -> None:
    """Section 4: host time of 20 layered H2D enqueues of ``n`` consecutive pages into
    consecutive L1 pages, by row DMAs out of the ring and straight, each behind a sleep."""
    events = [torch.cuda.Event() for _ in range(l1.geometry.num_layers)]  # type: ignore[no-untyped-call]
    for name, kw in (("row DMAs", {"d2d_min_bytes": 0}), ("straight", {"d2d_runs": 0})):
        engine = TransferEngine(l1, l2, "auto", straight_max_pages=n, **kw)  # type: ignore[arg-type]
        src, dst = list(range(n)), list(range(n + 4, 2 * n + 4))
        engine.h2d(src, dst, events).wait()
        profiler = cProfile.Profile()
        enqueue = []
        for _ in range(20):
            torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
            ticket = profiler.runcall(engine.h2d, src, dst, events)
            ticket.wait()
            enqueue.append(ticket.timings.enqueue_s * 1e3)
        status = engine.status()
        print(
            f"\n4. {name}: enqueue median {statistics.median(enqueue):.3f} ms "
            f"(d2d {status['d2d']}, straight {status['straight']}); own host time of 20 enqueues:"
        )
        pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=15)
    ap.add_argument("--only-profile", action="store_true", help="section 4 alone")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not dma.AVAILABLE:
        print("needs CUDA and cuda-python", file=sys.stderr)
        return 2
    g, n, reps = QWEN3_8B, args.pages, args.reps
    layers = g.num_layers
    l1, l2 = random_pools(g, 2 * 256 + 8)
    nbytes = n * g.bytes_per_page
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    streams: list[Any] = [dma.new_stream(torch.device("cuda")) for _ in range(4)]
    x = torch.randn(22, 4096, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(4096, 12288, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

    def compute() -> None:
        for i in range(300):
            x @ weights[i % 4]

    if args.profile:
        profile(l1, l2, n, args.profile)
    if args.only_profile:
        return 0
    plain = device_span(lambda: dma.copy_raw(dev.data_ptr(), host.data_ptr(), nbytes, streams[0]), streams[:1], reps)
    plain_beside = device_span(
        lambda: dma.copy_raw(dev.data_ptr(), host.data_ptr(), nbytes, streams[0]), streams[:1], reps, compute
    )
    print(
        f"{torch.cuda.get_device_name()}, {n} pages ({nbytes / 2**20:.0f} MiB): plain H2D {plain:.3f} ms alone, "
        f"{plain:.3f}/{plain_beside:.3f} = {plain / plain_beside:.3f} of it beside the matmul loop"
    )
    slab = g.page_elements * l2.slabs.element_size()
    pitch, base, out = 2 * layers * slab, l2.slabs.data_ptr(), dev.data_ptr()

    def rows(c: int, k: int) -> Callable[[], None]:
        def go() -> None:
            for j, lo in enumerate(range(0, layers, c)):
                for kv in (0, 1):
                    dst = out + (lo * 2 + kv * c) * slab * n
                    src = base + (kv * layers + lo) * slab
                    dma.copy_rows_raw(dst, c * slab, src, pitch, c * slab, n, streams[j % k])

        return go

    print("\n1. strided row DMAs (rows = pages), ratio to the plain copy alone")
    for c, k in ((1, 1), (1, 2), (2, 1), (4, 1), (6, 1), (12, 1)):
        alone = device_span(rows(c, k), streams[:k], reps, None)
        beside = device_span(rows(c, k), streams[:k], reps, compute)
        print(
            f"  rows of {c} layer(s) ({c * slab // 1024:>4} KiB), {k} stream(s): alone {plain / alone:.3f}, "
            f"beside {plain / beside:.3f}"
        )

    # 2. wide H2D rows into a staging buffer, then device-to-device row copies into L1
    l1_pages = l1.num_pages
    p0 = 4  # the restore's first L1 page; n consecutive pages
    stage = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    st, l1_at = stage.data_ptr(), l1.slabs.data_ptr()

    def staged(first: int, most: int, two: bool, copies: bool = True) -> Callable[[], None]:
        groups = layer_groups(layers, first, most)
        ev = [torch.cuda.Event() for _ in groups]  # type: ignore[no-untyped-call]
        a, b = streams[0], streams[1] if two else streams[0]

        def go() -> None:
            at = 0
            for (lo, hi), e in zip(groups, ev, strict=True):
                c = hi - lo
                for kv in (0, 1):
                    dma.copy_rows_raw(st + at + kv * c * slab, 2 * c * slab, base + (kv * layers + lo) * slab,
                                      pitch, c * slab, n, a)  # fmt: skip
                if two:
                    e.record(a)
                    b.wait_event(e)
                if copies:
                    for kv in (0, 1):
                        for i in range(c):
                            row = kv * layers + lo + i
                            to, at_ = l1_at + (row * l1_pages + p0) * slab, st + at + (kv * c + i) * slab
                            dma.copy_rows_device(to, slab, at_, 2 * c * slab, slab, n, b)
                at += 2 * c * n * slab

        return go

    print("\n2. per layer group: wide H2D rows into a staging buffer (stream 0), row copies into L1 (D2D)")
    for first, most, two in ((2, 8, True), (2, 8, False), (4, 8, True), (1, 8, True)):
        k = 2 if two else 1
        for copies in (False, True):
            alone = device_span(staged(first, most, two, copies), streams[:k], reps, None)
            beside = device_span(staged(first, most, two, copies), streams[:k], reps, compute)
            print(
                f"  groups {first}->{most}, {'D2D on stream 1' if two else 'one stream    '}"
                f"{'' if copies else ' (H2D only)'}: alone {plain / alone:.3f}, beside {plain / beside:.3f}"
            )
    ok = torch.equal(l1.slabs[:, p0 : p0 + n].transpose(0, 1).cpu().view(torch.int16), l2.slabs[:n].view(torch.int16))
    print(f"  L1 pages bit-identical to L2 after the staged copies: {ok}")
    for split in (False, True):
        engine = TransferEngine(l1, l2, "auto", split_layered=split, straight_runs=0, layer_group=2)
        evs = [torch.cuda.Event() for _ in range(layers)]  # type: ignore[no-untyped-call]
        svc: list[float] = []

        def ring_h2d(e: TransferEngine = engine, ev: list[Any] = evs, out_: list[float] = svc) -> None:
            t = e.h2d(list(range(n)), list(range(p0, p0 + n)), ev)
            if not t.wait():
                raise RuntimeError("layered H2D failed")
            out_.append(t.timings.service_s * 1e3)

        other = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        for _ in range(reps + 1):
            other.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(other):
                compute()
            ring_h2d()
            torch.cuda.synchronize()
        how = "split" if split else "one stream"
        print(f"  engine ring, groups 2->8, {how}: beside {plain / statistics.median(svc[1:]):.3f}")

    print("\n3. ring D2H / H2D of fragmented L2 pages (batched DMA call per chunk)")
    ring = TransferEngine(l1, l2, "auto", copy_max_pages=0, direct_max_bytes=0, min_run_bytes=0)
    print(f"  batched call usable before: {dma.batch_usable()}")
    for m in (64, 256):
        k = m * g.bytes_per_page
        d = torch.empty(k, dtype=torch.uint8, device="cuda")
        h = torch.empty(k, dtype=torch.uint8, pin_memory=True)
        p = {
            "d2h": device_span(lambda: dma.copy_raw(h.data_ptr(), d.data_ptr(), k, streams[0]), streams[:1], reps),
            "h2d": device_span(lambda: dma.copy_raw(d.data_ptr(), h.data_ptr(), k, streams[0]), streams[:1], reps),
        }
        l1p, l2p = list(range(1, 2 * m, 2)), list(range(0, 2 * m, 2))
        for direction in ("d2h", "h2d"):
            svc, walls = [], []
            for _ in range(reps + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                t = ring.d2h(l1p, l2p) if direction == "d2h" else ring.h2d(l2p, l1p)
                if not t.wait():
                    raise RuntimeError(f"{direction} failed")
                walls.append((time.perf_counter() - t0) * 1e3)
                svc.append(t.timings.service_s * 1e3)
            print(
                f"  {m:>3} pages {direction}: service {p[direction] / statistics.median(svc[1:]):.3f} of plain "
                f"(device), wall {p[direction] / statistics.median(walls[1:]):.3f}; batched call usable: "
                f"{dma.batch_usable()}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
