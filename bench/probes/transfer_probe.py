"""Probe: where the transfer engine loses time against the copy engine, per mechanism.

Qwen3-8B page geometry (2.25 MiB pages). Prints, each against a plain copy of the same bytes
measured in the same run (CUDA events around the work on one stream):

* ``gather``/``scatter``: the Triton kernels at each block size and warp count, against a
  device-to-device copy (the figure ``bench/transfer.py`` reports as gather/scatter ratio);
* ``frag``: fragmented L2 pages (every other page): one ``cudaMemcpyAsync`` per page out of
  (into) a contiguous device buffer, the same as one ``cudaMemcpyBatchAsync`` (when the
  runtime has it), and the per-page 2D copy straight from (to) the L1 pool;
* ``ring``: consecutive pages through the engine's ring at several chunk sizes (how much of
  a transfer the first gather, or the last scatter, leaves out of the overlap).

    python bench/probes/transfer_probe.py [--pages 64 256] [--reps 20]
"""

# ruff: noqa: B023  (every closure below is called before its loop moves on)
from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from hicache.backends import dma, kernels
from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.transfer import TransferEngine
from hicache.core.geometry import KVGeometry

_Event: Any = torch.cuda.Event
G = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)


def device_ms(fn: Callable[[], Any], reps: int, queued: bool = True) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = _Event(enable_timing=True), _Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(2_000_000)  # type: ignore[no-untyped-call]
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(float(a.elapsed_time(b)))
    return statistics.median(times)


def wall_ms(fn: Callable[[], Any], reps: int) -> float:
    import time

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    top = max(args.pages)
    l1 = DevicePool.allocate(G, 2 * top + 8, "cuda")
    l2 = HostPool(G, 2 * top + 8)
    page = G.bytes_per_page
    stream: Any = dma.new_stream(torch.device("cuda"))  # batched copies refuse the legacy default stream
    for n in args.pages:
        nbytes = n * page
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        plain = {
            "d2h": device_ms(lambda: host.copy_(dev, non_blocking=True), args.reps),
            "h2d": device_ms(lambda: dev.copy_(host, non_blocking=True), args.reps),
        }
        plain_wall = {
            "d2h": wall_ms(lambda: host.copy_(dev, non_blocking=True), args.reps),
            "h2d": wall_ms(lambda: dev.copy_(host, non_blocking=True), args.reps),
        }
        print(f"\n== {n} pages ({nbytes / 2**20:.0f} MiB): plain d2h {plain['d2h']:.3f} ms, h2d {plain['h2d']:.3f} ms")
        # gather / scatter sweep
        ids = torch.arange(0, 2 * n, 2, device="cuda")
        packed = torch.empty((n, 2 * G.num_layers, G.page_elements), dtype=G.dtype, device="cuda")
        src = l1.buffer.view(-1)[: packed.numel()]
        d2d = device_ms(lambda: packed.view(-1).copy_(src), args.reps)
        d2d_launch = device_ms(lambda: packed.view(-1).copy_(src), args.reps, queued=False)
        g0 = device_ms(lambda: kernels.gather_triton(l1.slabs, ids, packed), args.reps, queued=False)
        print(
            f"d2d copy {d2d:.4f} ms queued, {d2d_launch:.4f} ms with its launch; default gather with its launch: "
            f"{d2d_launch / g0:.3f}"
        )
        best: dict[str, tuple[float, int, int]] = {}
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (2, 4, 8, 16):
                if block // (32 * warps) < 8:
                    continue
                g = device_ms(lambda: kernels.gather_triton(l1.slabs, ids, packed, block=block, warps=warps), args.reps)
                s = device_ms(
                    lambda: kernels.scatter_triton(packed, ids, l1.slabs, block=block, warps=warps), args.reps
                )
                print(f"  block {block:5d} warps {warps:2d}: gather {d2d / g:.3f} scatter {d2d / s:.3f}")
                for name, t in (("gather", g), ("scatter", s)):
                    if name not in best or t < best[name][0]:
                        best[name] = (t, block, warps)
        for name, (t, block, warps) in best.items():
            print(f"  best {name}: {d2d / t:.3f} at block {block} warps {warps}")
        # fragmented L2: every other page
        l2_pages = list(range(0, 2 * n, 2))
        base_h = l2.slabs.data_ptr()
        base_d = packed.data_ptr()
        dst_h = [base_h + p * page for p in l2_pages]
        src_d = [base_d + i * page for i in range(n)]

        def per_page(d2h: bool) -> None:
            for a, b in zip(src_d, dst_h, strict=True):
                dma.copy_raw(b, a, page, stream) if d2h else dma.copy_raw(a, b, page, stream)

        for d2h in (True, False):
            key = "d2h" if d2h else "h2d"
            t = device_ms(lambda: per_page(d2h), args.reps)
            w = wall_ms(lambda: per_page(d2h), args.reps)
            print(f"  frag {key} per-page 1D DMA: {plain[key] / t:.3f} (device), host+device {w:.3f} ms")
            if dma.batch_usable():  # the engine's batched call (bench/probes/copy_overhead.py: its variants)
                pairs = list(zip(dst_h, src_d, [page] * n, strict=True))
                back = [(d, h, size) for h, d, size in pairs]
                t = device_ms(lambda: dma.copy_batch(pairs if d2h else back, stream), args.reps)
                print(f"  frag {key} batched DMA:     {plain[key] / t:.3f} (still batched: {dma.batch_usable()})")
        # engine paths
        l1_pages = list(range(0, 2 * n, 2))
        for label, kw in (
            ("copy path", {"copy_max_pages": 1 << 20}),
            ("direct", {"copy_max_pages": 0, "direct_max_bytes": 1 << 40}),
            ("ring 64MiB x4", {"copy_max_pages": 0, "direct_max_bytes": 0}),
            ("ring 32MiB x8", {"copy_max_pages": 0, "direct_max_bytes": 0, "chunk_bytes": 32 << 20, "chunks": 8}),
            ("ring 16MiB x16", {"copy_max_pages": 0, "direct_max_bytes": 0, "chunk_bytes": 16 << 20, "chunks": 16}),
            ("default", {}),
        ):
            engine = TransferEngine(l1, l2, "triton", min_run_bytes=0, **kw)  # type: ignore[arg-type]
            for layout, pages in (("consecutive", list(range(n))), ("fragmented", l2_pages)):
                out = []
                for d2h in (True, False):
                    key = "d2h" if d2h else "h2d"

                    def go(e: TransferEngine = engine, d: bool = d2h, p: list[int] = pages) -> None:
                        (e.d2h(l1_pages, p) if d else e.h2d(p, l1_pages)).wait()

                    out.append(f"{key} {plain_wall[key] / wall_ms(go, args.reps):.3f}")
                print(f"  engine {label:15s} {layout:11s}: {', '.join(out)} (wall, incl. host)")
            engine.synchronize()
            del engine
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
