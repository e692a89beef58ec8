"""L1 <-> L2 transfer bandwidth against a plain pinned copy of the same bytes (same run).

Qwen3-8B geometry (36 layers, 8 KV heads, head dim 128, bf16), page size 16 (2.25 MiB per
page). For 1..1024 pages, consecutive and fragmented L2 pages, per direction: effective
GiB/s end to end (call to completion) and its ratio to ``pinned.copy_(device,
non_blocking=True)`` of the same byte count; gather/scatter kernel GiB/s (Triton and torch)
against a device-to-device copy of the same bytes; speed-up over a naive copy (one copy per
page per layer per K/V). Writes JSON + PNG under bench/results/. Needs CUDA.

    python bench/transfer.py [--pages 1 4 16 64 256 1024] [--reps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch

from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.ticket import Ticket
from hicache.backends.transfer import GATHER, SCATTER, Copy, TransferEngine
from hicache.core.geometry import KVGeometry

QWEN3_8B = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)


def wall(fn: Callable[[], Any], reps: int) -> float:
    """Median wall seconds of ``fn`` (which must synchronize) after one warm-up."""
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def gpu(fn: Callable[[], Any], reps: int) -> float:
    """Median device seconds of ``fn`` measured with CUDA events."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(float(a.elapsed_time(b)) / 1e3)
    return statistics.median(samples)


def measure(
    n: int,
    l1: DevicePool,
    l2: HostPool,
    engine: TransferEngine,
    plain_dev: torch.Tensor,
    plain_host: torch.Tensor,
    reps: int,
    naive_max: int,
) -> dict[str, Any]:
    """Every figure for transfers of ``n`` pages."""
    g = l1.geometry
    gib = 2.0**30
    nbytes = n * g.bytes_per_page
    l1_src = list(range(0, 2 * n, 2))  # L1 pages are scattered in the pool
    l1_dst = list(range(1, 2 * n, 2))
    row: dict[str, Any] = {"pages": n, "bytes": nbytes}

    def plain_d2h() -> None:
        plain_host[:nbytes].copy_(plain_dev[:nbytes], non_blocking=True)
        torch.cuda.synchronize()

    def plain_h2d() -> None:
        plain_dev[:nbytes].copy_(plain_host[:nbytes], non_blocking=True)
        torch.cuda.synchronize()

    row["plain_d2h_gibs"] = nbytes / gib / wall(plain_d2h, reps)
    row["plain_h2d_gibs"] = nbytes / gib / wall(plain_h2d, reps)
    for label, l2_pages in (("consecutive", list(range(n))), ("fragmented", list(range(0, 2 * n, 2)))):
        tickets: list[Ticket] = []

        def d2h(pages: list[int] = l2_pages, out: list[Ticket] = tickets) -> None:
            t = engine.d2h(l1_src, pages)
            t.wait()
            out.append(t)

        def h2d(pages: list[int] = l2_pages, out: list[Ticket] = tickets) -> None:
            t = engine.h2d(pages, l1_dst)
            t.wait()
            out.append(t)

        for name, fn, plain in (("d2h", d2h, row["plain_d2h_gibs"]), ("h2d", h2d, row["plain_h2d_gibs"])):
            tickets.clear()
            row[f"{name}_{label}_gibs"] = nbytes / gib / wall(fn, reps)
            row[f"{name}_{label}_ratio"] = row[f"{name}_{label}_gibs"] / plain
            row[f"{name}_{label}_enqueue_ms"] = statistics.median(t.timings.enqueue_s for t in tickets) * 1e3
            row[f"{name}_{label}_service_ms"] = statistics.median(t.timings.service_s for t in tickets) * 1e3
            row[f"{name}_{label}_total_ms"] = statistics.median(t.timings.total_s for t in tickets) * 1e3
    ids = torch.tensor(l1_src, device="cuda")
    ids_dst = torch.tensor(l1_dst, device="cuda")
    packed = torch.empty((n, 2 * g.num_layers, g.page_elements), dtype=g.dtype, device="cuda")
    flat_src = l1.buffer.view(-1)[: packed.numel()]
    flat_dst = packed.view(-1)
    row["d2d_copy_gibs"] = nbytes / gib / gpu(lambda: flat_dst.copy_(flat_src), reps)
    for impl in ("torch", "triton"):
        gather, scatter = GATHER[impl], SCATTER[impl]

        def run_gather(f: Copy = gather) -> None:
            f(l1.slabs, ids, packed)

        def run_scatter(f: Copy = scatter) -> None:
            f(packed, ids_dst, l1.slabs)

        row[f"gather_{impl}_gibs"] = nbytes / gib / gpu(run_gather, reps)
        row[f"scatter_{impl}_gibs"] = nbytes / gib / gpu(run_scatter, reps)
    row["gather_ratio"] = max(row["gather_torch_gibs"], row["gather_triton_gibs"]) / row["d2d_copy_gibs"]
    row["scatter_ratio"] = max(row["scatter_torch_gibs"], row["scatter_triton_gibs"]) / row["d2d_copy_gibs"]
    if n <= naive_max:

        def naive() -> None:
            for i, p in enumerate(l1_src):
                for kv in range(2):
                    for layer in range(g.num_layers):
                        l2.page_buffer[i, kv, layer].copy_(l1.buffer[kv, layer, p], non_blocking=True)
            torch.cuda.synchronize()

        row["naive_d2h_gibs"] = nbytes / gib / wall(naive, max(2, reps // 4))
        row["speedup_over_naive"] = row["d2h_consecutive_gibs"] / row["naive_d2h_gibs"]
    print(f"  {n} pages done", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--naive-max", type=int, default=256, help="largest n for the naive per-layer copy")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/transfer.py needs CUDA")
    g = QWEN3_8B
    top = max(args.pages)
    l1 = DevicePool.allocate(g, 2 * top + 8, "cuda")
    l1.buffer.copy_(torch.randn(l1.buffer.shape, device="cuda", dtype=torch.bfloat16))
    l2 = HostPool(g, 2 * top + 8)
    engine = TransferEngine(l1, l2, "auto")
    engine.d2h([0], [0]).wait()  # autotune now, outside the timings
    plain_dev = torch.empty(top * g.bytes_per_page, dtype=torch.uint8, device="cuda")
    plain_host = torch.empty(top * g.bytes_per_page, dtype=torch.uint8, pin_memory=True)
    rows = [measure(n, l1, l2, engine, plain_dev, plain_host, args.reps, args.naive_max) for n in args.pages]
    meta = {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "geometry": "Qwen3-8B (36 layers, 8 KV heads, head dim 128, bf16), page size 16",
        "bytes_per_page": g.bytes_per_page,
        "engine": engine.status(),
    }
    print(f"\nL1<->L2 transfers, {meta['device']}, {meta['date']}, {meta['geometry']}")
    print(f"autotune: gather={engine.gather_backend} scatter={engine.scatter_backend} {engine.autotune_ms}")
    print("median ms per transfer (enqueue / device service / total):")
    for r in rows:
        parts = [
            f"{k} {r[f'{k}_enqueue_ms']:.2f}/{r[f'{k}_service_ms']:.2f}/{r[f'{k}_total_ms']:.2f}"
            for k in ("d2h_consecutive", "h2d_consecutive", "d2h_fragmented", "h2d_fragmented")
        ]
        print(f"  {r['pages']:>5} pages: " + "  ".join(parts))
    hdr = (
        f"{'pages':>5} {'MiB':>7} {'plain D2H':>9} {'D2H cons':>8} {'ratio':>5} {'D2H frag':>8} {'ratio':>5}"
        f" {'plain H2D':>9} {'H2D cons':>8} {'ratio':>5} {'H2D frag':>8} {'ratio':>5}"
        f" {'gather/d2d':>10} {'scatter/d2d':>11} {'vs naive':>8}"
    )
    print(hdr)
    for r in rows:
        vs_naive = f"{r['speedup_over_naive']:>7.1f}x" if "speedup_over_naive" in r else f"{'-':>8}"
        print(
            f"{r['pages']:>5} {r['bytes'] / 2**20:>7.0f} {r['plain_d2h_gibs']:>9.1f} {r['d2h_consecutive_gibs']:>8.1f}"
            f" {r['d2h_consecutive_ratio']:>5.2f} {r['d2h_fragmented_gibs']:>8.1f} {r['d2h_fragmented_ratio']:>5.2f}"
            f" {r['plain_h2d_gibs']:>9.1f} {r['h2d_consecutive_gibs']:>8.1f} {r['h2d_consecutive_ratio']:>5.2f}"
            f" {r['h2d_fragmented_gibs']:>8.1f} {r['h2d_fragmented_ratio']:>5.2f}"
            f" {r['gather_ratio']:>10.2f} {r['scatter_ratio']:>11.2f} {vs_naive}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"transfer-{meta['date']}-h200"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    xs = [r["pages"] for r in rows]
    for key, label in (
        ("plain_d2h_gibs", "plain pinned D2H"),
        ("d2h_consecutive_gibs", "hicache D2H consecutive"),
        ("d2h_fragmented_gibs", "hicache D2H fragmented"),
        ("naive_d2h_gibs", "naive per-layer D2H"),
    ):
        axes[0].plot(
            [r["pages"] for r in rows if key in r], [r[key] for r in rows if key in r], marker="o", label=label
        )
    for key, label in (
        ("plain_h2d_gibs", "plain pinned H2D"),
        ("h2d_consecutive_gibs", "hicache H2D consecutive"),
        ("h2d_fragmented_gibs", "hicache H2D fragmented"),
    ):
        axes[1].plot(xs, [r[key] for r in rows], marker="o", label=label)
    for key in (
        "d2d_copy_gibs",
        "gather_triton_gibs",
        "gather_torch_gibs",
        "scatter_triton_gibs",
        "scatter_torch_gibs",
    ):
        axes[2].plot(xs, [r[key] for r in rows], marker="o", label=key.replace("_gibs", ""))
    for ax, title in zip(axes, ("D2H GiB/s", "H2D GiB/s", "on-device GiB/s (bytes moved)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pages (2.25 MiB each)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"hicache transfers, {meta['device']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=100)
    print(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    main()
