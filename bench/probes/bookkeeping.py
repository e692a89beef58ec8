"""Probe: the host time of each hicache call on the L2 (or L3) restore path, timed one by one.

No model runs (the "prefill" writes random KV); two prefixes alternate so every request
restores from L2 (``--tier l3``: L2 holds one prefix, so every request restores from L3).
Prints the median host milliseconds per call and the bytes moved; ``--profile N`` also
prints the N functions with the most own time inside the timed calls (cProfile; ``--sort
cumulative``: the most time inside them).

    python bench/probes/bookkeeping.py --prefix-tokens 3500 [--tier l3] [--profile 25]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hicache import HiCache, HiCacheConfig
from hicache.core.geometry import KVGeometry

T = TypeVar("T")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefix-tokens", type=int, default=3500)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--tier", choices=["l2", "l3"], default="l2")
    ap.add_argument("--profile", type=int, default=0, help="print this many functions (--sort: by own time)")
    ap.add_argument("--sort", choices=["tottime", "cumulative"], default="tottime", help="the profile's order")
    ap.add_argument(
        "--kv",
        choices=["qwen3-8b", "tiny"],
        default="qwen3-8b",
        help="KV geometry; tiny (1 layer, 1 head, dim 2) leaves the host bookkeeping without the copies",
    )
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    g = (
        KVGeometry(36, 8, 128, args.page_size, dtype)
        if args.kv == "qwen3-8b"
        else KVGeometry(1, 1, 2, args.page_size, dtype)
    )
    ps = args.page_size
    pages = -(-(args.prefix_tokens + 9) // ps)
    l3 = args.tier == "l3"
    cache = HiCache(
        HiCacheConfig(
            g,
            l1_pages=pages + pages // 2,
            l2_pages=pages + pages // 2 if l3 else 3 * pages,
            l3_pages=4 * pages if l3 else 0,
            policy="always",
            device=args.device,
        )
    )
    profiler = cProfile.Profile() if args.profile else None
    gen = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(100, 150000, (args.prefix_tokens,), generator=gen).tolist() for _ in range(2)]
    times: dict[str, list[float]] = defaultdict(list)
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(name: str, fn: Callable[..., T], *a: Any) -> T:
        t0 = time.perf_counter()
        out = profiler.runcall(fn, *a) if profiler is not None and timing else fn(*a)
        times[name].append(time.perf_counter() - t0)
        return out

    timing = False

    for i in range(2 * (args.iterations + 2)):
        prompt = prefixes[i % 2] + [i % 100] * 8
        cache.drain()
        sync()
        if i == 4:
            times.clear()
            timing = True
        req = timed("admit", cache.admit, prompt)
        plan = timed("plan", cache.plan, req)
        pending = timed("start_restore", cache.start_restore, req, plan)
        while pending is not None and not pending.finished:
            timed("poll (per call)", cache.poll)
        cached = min(req.cached_len, (len(prompt) - 1) // ps * ps)
        need = -(-(len(prompt) + 1) // ps) - cached // ps
        own = timed("allocate", cache.allocate, req, need)
        assert own is not None
        timed("prefix_pages", cache.prefix_pages, req)
        cache.l1.buffer[:, :, own] = torch.randn(cache.l1.buffer[:, :, own].shape, dtype=dtype, device=args.device)
        sync()
        aligned = len(prompt) - len(prompt) % ps
        timed("insert", cache.insert, req, own[: max(0, aligned // ps - req.cached_len // ps)])
        timed("prefix_pages", cache.prefix_pages, req)
        timed("release", cache.release, req)
    print(
        f"host ms per call, median of {args.iterations * 2} requests, {args.prefix_tokens}-token prefix, {args.device}"
    )
    total = 0.0
    for name, ts in times.items():
        per_request = sum(ts) / (2 * args.iterations)
        total += per_request
        print(f"  {name:<18} median {statistics.median(ts) * 1e3:8.3f}   per request {per_request * 1e3:8.3f}")
    print(f"  {'total':<18} {'':>15}   per request {total * 1e3:8.3f}")
    m = cache.metrics.directions
    print("  H2D enqueue ms (mean):", round(m["H2D"].enqueue_s / max(1, m["H2D"].count) * 1e3, 3))
    print("  D2H enqueue ms (mean):", round(m["D2H"].enqueue_s / max(1, m["D2H"].count) * 1e3, 3))
    if profiler is not None:
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(args.profile)
    cache.close()


if __name__ == "__main__":
    main()
