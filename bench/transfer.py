"""L1 <-> L2 transfers against a plain pinned copy of the same bytes, measured in the same run.

For each size (pages), consecutive and fragmented L2 pages (every other page), D2H and
H2D: the time from the call to the completed ticket of

* ``default``: the engine as configured (its own choice of path per size),
* ``ring``: forced through the ring (gather/scatter + DMA, chunk by chunk),
* ``direct``: forced direct (one kernel on the pinned L2 pages in place; Triton only),

each as GiB/s and as a ratio to ``pinned.copy_(device)`` (D2H) / ``device.copy_(pinned)``
(H2D) of the same byte count. The samples are side by side: each round runs the plain
copies and every engine once, and a ratio is the median of its rounds' ratios. And the
gather/scatter kernels (Triton, torch) against a device-to-device copy of the same bytes.
L1 pages are every other page of the pool. It
prints a table, the size up to which ``direct`` beat ``ring`` (the value for
``TransferEngine(direct_max_bytes=...)``), and writes JSON (with meta: versions, commit,
device, date) and a PNG to ``--out`` (default ``$HICACHE_BENCH_OUT`` or /tmp/hicache-bench).

CUDA: the Qwen3-8B KV geometry (36 layers, 8 KV heads, head dim 128, bf16, page 16:
2.25 MiB per page). CPU (CI smoke test): a small geometry, small sizes, the torch backend.

    python bench/transfer.py [--pages 1 4 16 64 256 1024] [--reps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

try:  # NOTE: these import torch (seconds): Ctrl-C there ends as it does later, one line and 130
    import torch
    from common import (
        at_least,
        between,
        file_stem,
        git_commit,
        guarded,
        out_dir,
        results_done,
        tag_name,
        torch_device,
        unfinished,
    )

    from hicache.backends import kernels
    from hicache.backends.pools import DevicePool, HostPool
    from hicache.backends.ticket import Ticket
    from hicache.backends.transfer import GATHER, SCATTER, Copy, TransferEngine
    from hicache.core.geometry import KVGeometry
    from hicache.engine.cli import ArgParser
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    raise SystemExit(130) from None

QWEN3_8B = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
SMALL = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
MAX_PAGES = 4096  # 9 GiB of Qwen3-8B pages per pool: the largest a transfer bench needs
TARGETS = {1: 0.5, 4: 0.8, 16: 0.8, 64: 0.95, 256: 0.95, 1024: 0.95}  # ratio to the plain pinned copy
LAYOUTS = ("consecutive", "fragmented")
QUEUE_CYCLES = 2_000_000  # ~1 ms of GPU sleep: longer than any launch


def target(pages: int) -> float:
    """The bar for a transfer of ``pages`` pages (the largest listed size not above it)."""
    return TARGETS[max(k for k in TARGETS if k <= pages)] if pages >= 1 else 0.0


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def wall(fn: Callable[[], Any], reps: int) -> float:
    """Median wall seconds of ``fn`` (which must finish its work) after one warm-up."""
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Wall seconds of each of ``fns`` (each must finish its work), sampled side by side:
    one warm-up each, then ``reps`` rounds that run every one once, each round starting one
    further along the list. A drift of the machine over the run (clocks, another tenant)
    then falls on every figure alike instead of on whichever was measured last."""
    names = list(fns)
    for name in names:
        fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - t0)
    return samples


def device_time(fn: Callable[[], Any], reps: int, cuda: bool) -> float:
    """Median device seconds of ``fn`` (CUDA events; wall time on CPU). Each sample is queued
    behind a short sleep kernel, so the GPU is busy while ``fn`` is launched: the figure is
    the work's own time, without the host's launch latency (the engines' ``enqueue_ms`` is
    their host time per transfer; the kernels' launch is not reported on its own)."""
    if not cuda:
        return wall(fn, reps)
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda._sleep(QUEUE_CYCLES)  # type: ignore[no-untyped-call]
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(float(a.elapsed_time(b)) / 1e3)
    return statistics.median(samples)


def device_span(fn: Callable[[], Any], streams: list[Any], reps: int, side: Callable[[], Any] | None = None) -> float:
    """Median device ms from the first to the last of ``fn``'s work on ``streams`` (the first
    leads, the others wait for it and are joined back), each sample queued behind a short
    sleep, after one discarded; ``side`` (a stand-in forward) queued first on a stream of
    its own when given, so ``fn`` runs beside it. For the probes in bench/probes."""
    main, other = streams[0], torch.cuda.Stream()  # type: ignore[no-untyped-call]
    out = []
    for i in range(reps + 1):
        with torch.cuda.stream(main):
            torch.cuda._sleep(QUEUE_CYCLES)  # type: ignore[no-untyped-call]
        if side is not None:
            other.wait_stream(main)
            with torch.cuda.stream(other):
                side()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record(main)
        for s in streams[1:]:
            s.wait_event(a)
        fn()
        for s in streams[1:]:
            main.wait_stream(s)
        b.record(main)
        b.synchronize()
        main.wait_stream(other)
        torch.cuda.synchronize()
        if i:
            out.append(float(a.elapsed_time(b)))
    return float(statistics.median(out))


def probe_parser(doc: str | None, reps: int) -> argparse.ArgumentParser:
    """The layered probes' common flags: ``--pages`` (219 = 3,500 tokens), ``--reps`` and
    ``--profile`` (how many functions to print by own host time)."""
    ap = ArgParser("python bench/transfer.py", doc)
    ap.add_argument("--pages", type=int, default=219, help="219 pages = 3,500 tokens")
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--profile", type=int, default=0, help="print this many functions by own host time")
    return ap


def random_pools(g: KVGeometry, pages: int) -> tuple[DevicePool, HostPool]:
    """An L1 pool on CUDA and an L2 pool of ``pages`` pages each, L2 random bits (as int16:
    random bf16 patterns include NaNs, which never compare equal as values)."""
    l2 = HostPool(g, pages)
    l2.slabs.view(torch.int16).random_(-(2**15), 2**15 - 1)
    return DevicePool.allocate(g, pages, "cuda"), l2


def gpu(fn: Callable[[], Any], reps: int) -> float:
    """Median device seconds of ``fn`` on CUDA (used by bench/probes/layer_load.py)."""
    return device_time(fn, reps, True)


class Setup:
    """The pools, the engines (default, ring, direct) and the plain copy buffers."""

    def __init__(self, geometry: KVGeometry, top: int, device: str, backend: str, l1_pages: int = 0) -> None:
        self.cuda = device.startswith("cuda")
        g = self.geometry = geometry
        # NOTE: a page's rows lie a pool's width apart in L1: the width is part of the measurement
        self.l1 = DevicePool.allocate(g, max(l1_pages, 2 * top + 8), device)
        self.l1.buffer.normal_()  # NOTE: in place: a float32 copy first would need twice the pool
        self.l2 = HostPool(g, 2 * top + 8, pin=self.cuda)
        self.engines: dict[str, TransferEngine] = {
            "default": TransferEngine(self.l1, self.l2, backend),  # type: ignore[arg-type]
            "ring": TransferEngine(self.l1, self.l2, backend, direct_max_bytes=0, min_run_bytes=0, copy_max_pages=0),  # type: ignore[arg-type]
        }
        copy = TransferEngine(self.l1, self.l2, backend, copy_max_pages=1 << 30)  # type: ignore[arg-type]
        if copy.copy_usable:
            self.engines["copy"] = copy
        direct = TransferEngine(
            self.l1,
            self.l2,
            backend,  # type: ignore[arg-type]
            direct_max_bytes=1 << 62,
            min_run_bytes=1 << 62,
            copy_max_pages=0,
        )
        if direct.direct_usable:
            self.engines["direct"] = direct
        for engine in self.engines.values():  # memory, autotune and compiles outside the timings
            for layout in (list(range(2)), [0, 2]):
                assert engine.d2h([0, 2], layout).wait() and engine.h2d(layout, [1, 3]).wait()
        nbytes = top * g.bytes_per_page
        self.plain_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.plain_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)


def measure(n: int, s: Setup, reps: int) -> dict[str, Any]:
    """Every figure for transfers of ``n`` pages."""
    g = s.geometry
    gib = 2.0**30
    nbytes = n * g.bytes_per_page
    l1_src = list(range(0, 2 * n, 2))  # L1 pages are scattered in the pool
    l1_dst = list(range(1, 2 * n, 2))
    row: dict[str, Any] = {"pages": n, "bytes": nbytes, "target": target(n)}

    def plain_d2h() -> None:
        s.plain_host[:nbytes].copy_(s.plain_dev[:nbytes], non_blocking=s.cuda)
        sync(s.cuda)

    def plain_h2d() -> None:
        s.plain_dev[:nbytes].copy_(s.plain_host[:nbytes], non_blocking=s.cuda)
        sync(s.cuda)

    fns: dict[str, Callable[[], Any]] = {"plain_d2h": plain_d2h, "plain_h2d": plain_h2d}
    tickets: dict[str, list[Ticket]] = {}
    for layout, l2_pages in (("consecutive", list(range(n))), ("fragmented", list(range(0, 2 * n, 2)))):
        for name, engine in s.engines.items():
            tag = "" if name == "default" else f"_{name}"
            for direction in ("d2h", "h2d"):
                key = f"{direction}_{layout}{tag}"
                out = tickets[key] = []

                def run(
                    e: TransferEngine = engine,
                    d: str = direction,
                    pages: list[int] = l2_pages,
                    out: list[Ticket] = out,
                ) -> None:
                    t = e.d2h(l1_src, pages) if d == "d2h" else e.h2d(pages, l1_dst)
                    if not t.wait():
                        raise RuntimeError(f"{d} of {n} pages failed: {t.error}")
                    out.append(t)

                fns[key] = run
    default = s.engines["default"].paths
    default.update(dict.fromkeys(default, 0))
    samples = interleaved(fns, reps)
    for direction in ("d2h", "h2d"):
        row[f"plain_{direction}_gibs"] = nbytes / gib / statistics.median(samples[f"plain_{direction}"])
    for key, out in tickets.items():
        plain = samples[f"plain_{key[:3]}"]
        row[f"{key}_gibs"] = nbytes / gib / statistics.median(samples[key])
        # each round's ratio to the plain copy of the same round (side by side), the median
        row[f"{key}_ratio"] = statistics.median(p / t for p, t in zip(plain, samples[key], strict=True))
        for part in ("enqueue", "service", "total"):
            row[f"{key}_{part}_ms"] = statistics.median(getattr(t.timings, f"{part}_s") for t in out[1:]) * 1e3
    row["default_paths"] = dict(default)
    dev = s.l1.slabs.device
    ids = torch.tensor(l1_src, device=dev)
    ids_dst = torch.tensor(l1_dst, device=dev)
    packed = torch.empty((n, 2 * g.num_layers, g.page_elements), dtype=g.dtype, device=dev)
    flat_src = s.l1.buffer.view(-1)[: packed.numel()]
    flat_dst = packed.view(-1)
    row["d2d_copy_gibs"] = nbytes / gib / device_time(lambda: flat_dst.copy_(flat_src), reps, s.cuda)
    impls = ["torch"] + (["triton"] if kernels.HAVE_TRITON and s.cuda else [])
    for impl in impls:
        gather, scatter = GATHER[impl], SCATTER[impl]

        def run_gather(f: Copy = gather) -> None:
            f(s.l1.slabs, ids, packed)

        def run_scatter(f: Copy = scatter) -> None:
            f(packed, ids_dst, s.l1.slabs)

        row[f"gather_{impl}_gibs"] = nbytes / gib / device_time(run_gather, reps, s.cuda)
        row[f"scatter_{impl}_gibs"] = nbytes / gib / device_time(run_scatter, reps, s.cuda)
    if "triton" in impls:  # other block sizes than the kernels' default (kernels.BLOCK)
        for block in (1024, 16384):

            def run_gather_b(b: int = block) -> None:
                kernels.gather_triton(s.l1.slabs, ids, packed, block=b)

            def run_scatter_b(b: int = block) -> None:
                kernels.scatter_triton(packed, ids_dst, s.l1.slabs, block=b)

            row[f"gather_triton_b{block}_gibs"] = nbytes / gib / device_time(run_gather_b, reps, s.cuda)
            row[f"scatter_triton_b{block}_gibs"] = nbytes / gib / device_time(run_scatter_b, reps, s.cuda)
    row["gather_ratio"] = max(row[f"gather_{i}_gibs"] for i in impls) / row["d2d_copy_gibs"]
    row["scatter_ratio"] = max(row[f"scatter_{i}_gibs"] for i in impls) / row["d2d_copy_gibs"]
    print(f"  {n} pages done", flush=True)
    return row


def direct_up_to(rows: list[dict[str, Any]]) -> int | None:
    """The largest size (bytes) up to which ``direct`` was at least as fast as ``ring``
    in every direction and layout at every measured size; None if never measured."""
    best = None
    for r in rows:
        keys = [f"{d}_{lay}" for d in ("d2h", "h2d") for lay in LAYOUTS]
        if f"{keys[0]}_direct_gibs" not in r:
            return None
        if not all(r[f"{k}_direct_gibs"] >= r[f"{k}_ring_gibs"] for k in keys):
            break
        best = r["bytes"]
    return best


def meta_of(s: Setup, device: str) -> dict[str, Any]:
    commit = git_commit()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    g = s.geometry
    return {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name() if s.cuda else "CPU",
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": (commit or "unknown").removesuffix("+dirty"),
        "dirty": bool(commit and commit.endswith("+dirty")),
        "geometry": f"{g.num_layers} layers, {g.num_kv_heads} KV heads, head dim {g.head_dim}, {g.dtype}, "
        f"page size {g.page_size}",
        "bytes_per_page": g.bytes_per_page,
        "l1_pages": s.l1.num_pages,
        "engines": {name: e.status() for name, e in s.engines.items()},
        "direct_up_to_bytes": None,
    }


def print_table(rows: list[dict[str, Any]], meta: dict[str, Any], names: list[str]) -> None:
    print(f"\nL1<->L2 transfers, {meta['device']}, {meta['date']}, {meta['geometry']}")
    e = meta["engines"]["default"]
    print(f"default engine: gather={e['gather']} scatter={e['scatter']} direct<={e['direct_max_bytes']} B")
    print("ratio to the plain pinned copy of the same bytes (target in brackets), per engine:")
    head = f"{'pages':>5} {'MiB':>7} {'target':>6}"
    for d in ("d2h", "h2d"):
        for lay in LAYOUTS:
            head += "  " + " ".join(f"{d.upper()} {lay[:4]} {n[:3]:>3}" for n in names)
    print(head + f" {'gath/d2d':>8} {'scat/d2d':>8}")
    for r in rows:
        line = f"{r['pages']:>5} {r['bytes'] / 2**20:>7.1f} {r['target']:>6.2f}"
        for d in ("d2h", "h2d"):
            for lay in LAYOUTS:
                cells = []
                for n in names:
                    key = f"{d}_{lay}{'' if n == 'default' else '_' + n}_ratio"
                    cells.append(f"{r[key]:>12.2f}" if key in r else f"{'-':>12}")
                line += "  " + " ".join(cells)
        print(line + f" {r['gather_ratio']:>8.2f} {r['scatter_ratio']:>8.2f}")
    blocks = sorted(k for k in rows[0] if k.startswith("gather_triton_b"))
    if blocks:
        print(f"gather/scatter GiB/s by Triton block (default {kernels.BLOCK}), against the d2d copy:")
        for r in rows:
            cells = [
                f"d2d {r['d2d_copy_gibs']:.0f}",
                f"b{kernels.BLOCK} {r['gather_triton_gibs']:.0f}/{r['scatter_triton_gibs']:.0f}",
            ]
            for k in blocks:
                b = k.removeprefix("gather_triton_").removesuffix("_gibs")
                cells.append(f"{b} {r[k]:.0f}/{r[f'scatter_triton_{b}_gibs']:.0f}")
            print(f"  {r['pages']:>5} pages: " + "  ".join(cells))
    print("median ms per default transfer (enqueue / device service / total):")
    for r in rows:
        parts = [
            f"{k} {r[f'{k}_enqueue_ms']:.3f}/{r[f'{k}_service_ms']:.3f}/{r[f'{k}_total_ms']:.3f}"
            for k in ("d2h_consecutive", "h2d_consecutive", "d2h_fragmented", "h2d_fragmented")
        ]
        print(f"  {r['pages']:>5} pages: " + "  ".join(parts))
    up_to = meta["direct_up_to_bytes"]
    if up_to is not None:
        print(f"direct was at least as fast as the ring up to {up_to / 2**20:.1f} MiB: direct_max_bytes={up_to}")


def plot(rows: list[dict[str, Any]], meta: dict[str, Any], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    xs = [r["pages"] for r in rows]
    for ax, d in zip(axes[:2], ("d2h", "h2d"), strict=True):
        for n in names:
            for lay, style in zip(LAYOUTS, ("-", "--"), strict=True):
                key = f"{d}_{lay}{'' if n == 'default' else '_' + n}_ratio"
                if key in rows[0]:
                    ax.plot(xs, [r[key] for r in rows], style, marker="o", label=f"{n}, {lay}")
        ax.step(xs, [r["target"] for r in rows], "k:", where="post", label="target")
        ax.set_title(f"{d.upper()}: hicache / plain pinned copy")
    for key, label in (("gather_ratio", "gather / d2d copy"), ("scatter_ratio", "scatter / d2d copy")):
        axes[2].plot(xs, [r[key] for r in rows], marker="o", label=label)
    axes[2].axhline(0.85, color="k", linestyle=":", label="target (>= 64 pages)")
    axes[2].set_title("on-device gather / scatter")
    for ax in axes:
        ax.set_ylim(0, max(1.1, ax.get_ylim()[1]))
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"pages ({meta['bytes_per_page'] / 2**20:.2f} MiB each)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"hicache L1<->L2 transfers, {meta['device']}, {meta['date']} (commit {meta['commit'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = ArgParser("python bench/transfer.py", __doc__)
    ap.add_argument("--device", type=torch_device, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--pages",
        type=between(1, MAX_PAGES),
        nargs="+",
        default=None,
        help=f"default: 1..1024 on CUDA, 1 4 16 on CPU (at most {MAX_PAGES})",
    )
    ap.add_argument("--reps", type=at_least(1), default=None, help="default: 10 on CUDA, 3 on CPU")
    ap.add_argument(
        "--l1-pages",
        type=between(1, 8 * MAX_PAGES),
        default=0,
        help="the L1 pool's pages (its width: a page's rows are that many pages apart); "
        "by default, and at least (a smaller value is raised to it): twice the largest size, plus 8",
    )
    ap.add_argument(
        "--backend",
        choices=["auto", "triton", "torch"],
        default=None,
        help="transfer backend (default: auto on CUDA, torch on CPU)",
    )
    ap.add_argument("--out", type=out_dir, default=Path(os.environ.get("HICACHE_BENCH_OUT", "/tmp/hicache-bench")))
    ap.add_argument("--tag", type=tag_name, default=None, help="file name tag (default: h200, or the device)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)  # NOTE: small CPU copies on a busy pool of threads stall ~20 ms at random
    pages = args.pages or ([1, 4, 16, 64, 256, 1024] if cuda else [1, 4, 16])
    reps = args.reps or (10 if cuda else 3)
    s = Setup(
        QWEN3_8B if cuda else SMALL,
        max(pages),
        args.device,
        args.backend or ("auto" if cuda else "torch"),
        args.l1_pages,
    )
    rows = [measure(n, s, reps) for n in pages]
    meta = meta_of(s, args.device)
    meta["direct_up_to_bytes"] = direct_up_to(rows)
    names = list(s.engines)
    print_table(rows, meta, names)
    tag = args.tag or ("h200" if "H200" in meta["device"] else meta["device"].lower().replace(" ", "-"))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"transfer-{meta['date']}-{file_stem(tag)}"
    unfinished(stem)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    plot(rows, meta, names, stem.with_suffix(".png"))
    results_done(stem)
    print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    guarded(main)
