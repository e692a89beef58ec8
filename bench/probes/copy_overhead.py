"""Probe: the fixed costs around a transfer's DMAs, and whether spreading them helps.

Qwen3-8B page geometry (2.25 MiB pages), against a plain copy of the same bytes:

* ``frag``: fragmented L2 pages (every other page), one ``cudaMemcpyAsync`` per page from a
  packed device buffer, issued on 1, 2 or 4 streams in turn (do per-DMA gaps overlap when
  two copy queues hold work?), and as one ``cudaMemcpyBatchAsync`` with several attribute
  choices (which ones the runtime accepts);
* ``small``: the engine's transfers of 1-64 pages, wall time against a plain copy's, and
  a host profile of the enqueue and wait (which calls the fixed cost is made of).

    python bench/probes/copy_overhead.py [--pages 64 256] [--small 4 16] [--reps 20]
"""

# ruff: noqa: B023  (every closure below is called before its loop moves on)
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the transfer bench's helpers
from transfer import QWEN3_8B, device_span, wall

from hicache.backends import dma
from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.transfer import TransferEngine

G = QWEN3_8B


def device_ms(fn: Callable[[], Any], reps: int, streams: list[Any]) -> float:
    """Median device ms of ``fn``'s work on ``streams`` (:func:`transfer.device_span`)."""
    return device_span(fn, streams, reps)


def wall_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median wall ms of ``fn`` and the GPU work it queued (:func:`transfer.wall`)."""

    def done() -> None:
        fn()
        torch.cuda.synchronize()

    return wall(done, reps) * 1e3


def batch_variants() -> dict[str, Callable[..., None]]:
    rt: Any = getattr(dma, "_rt", None)
    fn = getattr(rt, "cudaMemcpyBatchAsync", None) if rt is not None else None
    if fn is None:
        print("cudaMemcpyBatchAsync: not in this cuda-python")
        return {}
    out: dict[str, Callable[..., None]] = {}

    def attrs(flags: bool, hints: str | None) -> Any:
        a = rt.cudaMemcpyAttributes()
        a.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        if flags:
            a.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
        if hints is not None:
            host, dev = rt.cudaMemLocationType.cudaMemLocationTypeHost, rt.cudaMemLocationType.cudaMemLocationTypeDevice
            src, dst = (dev, host) if hints == "d2h" else (host, dev)
            a.srcLocHint.type, a.dstLocHint.type = src, dst
            a.srcLocHint.id = a.dstLocHint.id = 0
        return a

    for name, flags, hints in (("plain", False, None), ("overlap-flag", True, None), ("hints", False, "auto")):

        def run(
            dsts: list[int],
            srcs: list[int],
            sizes: list[int],
            stream: Any,
            d2h: bool,
            f: bool = flags,
            h: str | None = hints,
        ) -> None:
            a = attrs(f, None if h is None else ("d2h" if d2h else "h2d"))
            n = len(dsts)
            try:
                res = fn(dsts, srcs, sizes, n, [a], [0], 1, stream.cuda_stream)
            except TypeError:
                res = fn(dsts, srcs, sizes, n, [a], [0], 1, 0, stream.cuda_stream)
            err = res[0] if isinstance(res, tuple) else res
            if err != rt.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaMemcpyBatchAsync: {res!r}")

        out[name] = run
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--small", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    top = max(args.pages + args.small)
    l1 = DevicePool.allocate(G, 2 * top + 8, "cuda")
    l2 = HostPool(G, 2 * top + 8)
    page = G.bytes_per_page
    streams: list[Any] = [dma.new_stream(torch.device("cuda")) for _ in range(4)]
    batches = batch_variants()
    for n in args.pages:
        nbytes = n * page
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        plain = {
            "d2h": device_ms(
                lambda: dma.copy_raw(host.data_ptr(), dev.data_ptr(), nbytes, streams[0]), args.reps, streams[:1]
            ),
            "h2d": device_ms(
                lambda: dma.copy_raw(dev.data_ptr(), host.data_ptr(), nbytes, streams[0]), args.reps, streams[:1]
            ),
        }
        print(
            f"\n== frag, {n} pages ({nbytes / 2**20:.0f} MiB): plain d2h {plain['d2h']:.3f} ms, h2d {plain['h2d']:.3f}"
        )
        hs = [l2.slabs.data_ptr() + p * page for p in range(0, 2 * n, 2)]
        ds = [dev.data_ptr() + i * page for i in range(n)]
        for d2h in (True, False):
            key = "d2h" if d2h else "h2d"
            for k in (1, 2, 4):

                def spread(k: int = k, d2h: bool = d2h) -> None:
                    for i, (a, b) in enumerate(zip(ds, hs, strict=True)):
                        s = streams[i % k]
                        dma.copy_raw(b, a, page, s) if d2h else dma.copy_raw(a, b, page, s)

                t = device_ms(spread, args.reps, streams[:k])
                print(f"  {key} per-page DMAs on {k} stream(s): {plain[key] / t:.3f}")
            for name, batch in batches.items():
                try:
                    sizes = [page] * n
                    t = device_ms(
                        lambda: (
                            batch(hs, ds, sizes, streams[0], True) if d2h else batch(ds, hs, sizes, streams[0], False)
                        ),
                        args.reps,
                        streams[:1],
                    )
                    print(f"  {key} batched ({name}): {plain[key] / t:.3f}")
                except Exception as exc:  # a probe reports and goes on
                    print(f"  {key} batched ({name}) failed: {exc!r}")
    print("\n== small transfers: engine wall / plain wall (copy path default)")
    engine = TransferEngine(l1, l2, "triton")
    for n in args.small:
        nbytes = n * page
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pw = {
            "d2h": wall_ms(lambda: host.copy_(dev, non_blocking=True), args.reps),
            "h2d": wall_ms(lambda: dev.copy_(host, non_blocking=True), args.reps),
        }
        l1p, l2p = list(range(0, 2 * n, 2)), list(range(n))
        for d2h in (True, False):
            key = "d2h" if d2h else "h2d"

            def go(d: bool = d2h) -> None:
                (engine.d2h(l1p, l2p) if d else engine.h2d(l2p, l1p)).wait()

            w = wall_ms(go, args.reps)
            tickets = [engine.d2h(l1p, l2p) if d2h else engine.h2d(l2p, l1p) for _ in range(5)]
            for ticket in tickets:
                ticket.wait()
            enq = statistics.median(x.timings.enqueue_s for x in tickets) * 1e3
            svc = statistics.median(x.timings.service_s for x in tickets) * 1e3
            print(
                f"  {n:4d} pages {key}: ratio {pw[key] / w:.3f}  plain {pw[key]:.3f} ms  engine {w:.3f} ms "
                f"(enqueue {enq:.3f}, service {svc:.3f})"
            )
    for n in args.small[:2]:
        l1p, l2p = list(range(0, 2 * n, 2)), list(range(n))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            engine.h2d(l2p, l1p).wait()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
        print(f"\n== host profile, 200 x h2d of {n} pages + wait (tottime)")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:5000])
    with contextlib.suppress(Exception):
        engine.synchronize()


if __name__ == "__main__":
    main()
