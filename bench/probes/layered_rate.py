"""Probe: where a layered H2D loses rate against one plain pinned copy, and the ring's chunk
size at 64 pages.

Qwen3-8B KV geometry, on CUDA. Prints, each against a plain pinned copy of the same bytes
measured in the same run (median wall time of ``--reps``, synchronized):

1. strided row DMAs (``dma.copy_rows_raw``) of a consecutive L2 run into a device buffer,
   by rows of 1, 2, 4, 6, 12 and 36 layers (one K and one V DMA per group of layers);
2. the engine's layered H2D of a consecutive and a fragmented run, by layer-group schedule,
   through the ring on one stream and split over two (``split_layered``), and straight into
   one run of L1 pages (``straight_runs``);
3. a plain copy, the straight and the ring layered H2D beside a matmul loop on another
   stream (a stand-in forward: does the copy slow down beside it?);
4. D2H/H2D of 4 to 128 pages through engines with other ring chunk sizes and paths;
5. ``--profile N``: the N functions with the most own host time in 20 layered H2D enqueues.

    python bench/probes/layered_rate.py --pages 219
"""

from __future__ import annotations

import cProfile
import functools
import itertools
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the transfer bench's geometry
from transfer import QWEN3_8B, probe_parser, random_pools

from hicache.backends import dma
from hicache.backends.transfer import TransferEngine


def wall(fn: Callable[[], Any], reps: int) -> float:
    """Median wall seconds of ``fn`` followed by a device synchronize, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not dma.AVAILABLE:
        print("needs CUDA and cuda-python", file=sys.stderr)
        return 2
    g, n, reps = QWEN3_8B, args.pages, args.reps
    layers = g.num_layers
    l1, l2 = random_pools(g, 2 * n + 8)
    nbytes = n * g.bytes_per_page
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.current_stream()

    def plain_h2d(k: int = nbytes) -> None:
        dev[:k].copy_(host[:k], non_blocking=True)

    def plain_d2h(k: int = nbytes) -> None:
        host[:k].copy_(dev[:k], non_blocking=True)

    plain = wall(plain_h2d, reps)
    print(
        f"{torch.cuda.get_device_name()}, {n} pages ({nbytes / 2**20:.0f} MiB): plain H2D {plain * 1e3:.3f} ms "
        f"({nbytes / plain / 2**30:.1f} GiB/s)"
    )

    # 1. row DMAs by width
    slab = g.page_elements * l2.slabs.element_size()
    pitch = 2 * layers * slab
    base = l2.slabs.data_ptr()
    out = dev.data_ptr()
    print("\n1. strided row DMAs, one K and one V per group of layers, rows = pages")
    for count in (1, 2, 4, 6, 12, 36):

        def rows(c: int = count) -> None:
            for lo in range(0, layers, c):
                for kv in (0, 1):
                    dst = out + (lo * 2 + kv * c) * slab * n
                    src = base + (kv * layers + lo) * slab
                    dma.copy_rows_raw(dst, c * slab, src, pitch, c * slab, n, stream)

        t = wall(rows, reps)
        print(
            f"  {count:>2} layers ({count * slab // 1024:>5} KiB rows, {2 * layers // count:>2} DMAs): "
            f"{t * 1e3:7.3f} ms, {plain / t:.3f} of plain"
        )

    # 2. the engine's layered H2D by schedule
    events: list[Any] = [torch.cuda.Event() for _ in range(layers)]  # type: ignore[no-untyped-call]
    dst = list(range(1, 2 * n, 2))
    layouts = {"consecutive": list(range(n)), "fragmented": list(range(0, 2 * n, 2))}
    print("\n2. engine layered H2D (wall, incl. host)")
    for (first, most), split in itertools.product(((1, 8), (2, 8), (4, 8), (8, 8), (12, 12), (36, 36)), (False, True)):
        engine = TransferEngine(
            l1, l2, "auto", layer_group=first, max_layer_group=most, split_layered=split, straight_runs=0
        )
        for name, src in layouts.items():

            def layered(e: TransferEngine = engine, s: list[int] = src) -> None:
                if not e.h2d(s, dst, events).wait():
                    raise RuntimeError("layered H2D failed")

            t = wall(layered, reps)
            print(
                f"  groups {first}->{most} {name:<12}: {t * 1e3:7.3f} ms, {plain / t:.3f} of plain "
                f"({len(engine.layer_groups())} groups)"
            )
        # NOTE: as int16: random bit patterns include bf16 NaNs, never equal as values
        ok = torch.equal(
            l1.slabs.index_select(1, torch.tensor(dst, device="cuda")).transpose(0, 1).cpu().view(torch.int16),
            l2.slabs[layouts["fragmented"]].view(torch.int16),
        )
        print(f"    last pages bit-identical: {ok}")
        # the default schedule straight into one run of L1 pages (after the check: it
        # overwrites some of the pages checked)
        if (first, most) == (1, 8) and not split:
            straight = TransferEngine(
                l1, l2, "auto", layer_group=first, max_layer_group=most, straight_max_pages=n, d2d_runs=0
            )
            one_run = list(range(n + 4, 2 * n + 4))

            def straight_h2d(e: TransferEngine = straight, d: list[int] = one_run) -> None:
                if not e.h2d(layouts["consecutive"], d, events).wait():
                    raise RuntimeError("layered H2D failed")

            t = wall(straight_h2d, reps)
            same = torch.equal(
                l1.slabs[:, n + 4 : 2 * n + 4].transpose(0, 1).cpu().view(torch.int16),
                l2.slabs[:n].view(torch.int16),
            )
            print(
                f"  groups {first}->{most} straight   : {t * 1e3:7.3f} ms, {plain / t:.3f} of plain "
                f"({straight.status()['straight']} straight; pages bit-identical: {same})"
            )

    # 3. beside a matmul loop
    x = torch.randn(22, 4096, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(4096, 12288, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def compute() -> None:
        for i in range(300):
            x @ weights[i % 4]

    alone = wall(compute, reps)
    print(f"\n3. beside a matmul loop ({alone * 1e3:.2f} ms alone; it reads 100 MiB of weights per matmul)")

    def beside(copy: Callable[[], None], out_: list[float]) -> Callable[[], None]:
        """``copy`` on the current stream while ``compute`` runs on ``side``; its span to ``out_``."""

        def go() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                compute()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            a.record()
            copy()
            b.record()
            b.synchronize()
            torch.cuda.current_stream().wait_stream(side)
            out_.append(a.elapsed_time(b) / 1e3)

        return go

    timed: list[float] = []
    total = wall(beside(plain_h2d, timed), reps)
    print(
        f"  plain copy              : both {total * 1e3:7.3f} ms; H2D service "
        f"{statistics.median(timed) * 1e3:7.3f} ms, {plain / statistics.median(timed):.3f} of plain"
    )
    marks = [torch.cuda.Event() for _ in range(9)]  # type: ignore[no-untyped-call]

    def row_dmas(c: int, record: bool = False) -> Callable[[], None]:
        def go() -> None:
            for lo in range(0, layers, c):
                for kv in (0, 1):
                    dst_at = out + (lo * 2 + kv * c) * slab * n
                    src_at = base + (kv * layers + lo) * slab
                    dma.copy_rows_raw(dst_at, c * slab, src_at, pitch, c * slab, n, stream)
                if record and lo % 4 == 3:
                    marks[lo // 4].record(stream)

        return go

    for label, fn in (
        ("rows of 1 layer, 72 DMAs  ", row_dmas(1)),
        ("rows of 1 layer + 9 events", row_dmas(1, record=True)),
        ("rows of 36 layers, 2 DMAs ", row_dmas(36)),
    ):
        row_spans: list[float] = []
        wall(beside(fn, row_spans), reps)
        alone_t = wall(fn, reps)
        print(
            f"  {label}: H2D service {statistics.median(row_spans) * 1e3:7.3f} ms beside, "
            f"{plain / statistics.median(row_spans):.3f} of plain ({plain / alone_t:.3f} alone)"
        )
    straight = TransferEngine(l1, l2, "auto", straight_max_pages=n, d2d_runs=0)
    spans_straight: list[float] = []

    def straight_beside(out_: list[float] = spans_straight) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compute()
        t = straight.h2d(layouts["consecutive"], list(range(n + 4, 2 * n + 4)), events)
        t.wait()
        torch.cuda.current_stream().wait_stream(side)
        out_.append(t.timings.service_s)

    total = wall(straight_beside, reps)
    print(
        f"  consecutive  straight  : both {total * 1e3:7.3f} ms; H2D service "
        f"{statistics.median(spans_straight) * 1e3:7.3f} ms, {plain / statistics.median(spans_straight):.3f} of plain"
    )
    for (name, src), split in itertools.product(layouts.items(), (False, True)):
        engine = TransferEngine(l1, l2, "auto", split_layered=split)
        spans: list[float] = []

        def both(s: list[int] = src, out_: list[float] = spans, engine: TransferEngine = engine) -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                compute()
            t = engine.h2d(s, dst, events)
            t.wait()
            torch.cuda.current_stream().wait_stream(side)
            out_.append(t.timings.service_s)

        total = wall(both, reps)
        print(
            f"  {name:<12} {'split' if split else 'one stream':<10}: both {total * 1e3:7.3f} ms; "
            f"H2D service {statistics.median(spans) * 1e3:7.3f} ms, "
            f"{plain / statistics.median(spans):.3f} of plain"
        )

    # 4. small and medium transfers by ring chunk and path
    print("\n4. D2H / H2D by engine, consecutive | fragmented L2 (wall, incl. host)")
    configs: dict[str, dict[str, Any]] = {
        "default": {},
        "ring 64MiB x4": {"copy_max_pages": 0, "direct_max_bytes": 0, "min_run_bytes": 0},
        "ring 32MiB x8": {
            "copy_max_pages": 0,
            "direct_max_bytes": 0,
            "min_run_bytes": 0,
            "chunk_bytes": 32 << 20,
            "chunks": 8,
        },
        "ring 16MiB x16": {
            "copy_max_pages": 0,
            "direct_max_bytes": 0,
            "min_run_bytes": 0,
            "chunk_bytes": 16 << 20,
            "chunks": 16,
        },
        "ring 8MiB x32": {
            "copy_max_pages": 0,
            "direct_max_bytes": 0,
            "min_run_bytes": 0,
            "chunk_bytes": 8 << 20,
            "chunks": 32,
        },
        "copy": {"copy_max_pages": 1 << 30},
        "direct": {"copy_max_pages": 0, "direct_max_bytes": 1 << 62, "min_run_bytes": 1 << 62},
    }
    engines = {k: TransferEngine(l1, l2, "auto", **v) for k, v in configs.items()}
    for m in (4, 16, 64, 128):
        k = m * g.bytes_per_page
        p = {"d2h": wall(functools.partial(plain_d2h, k), reps), "h2d": wall(functools.partial(plain_h2d, k), reps)}
        l1_pages = list(range(1, 2 * m, 2))
        for name, e in engines.items():
            cells = []
            for direction in ("d2h", "h2d"):
                for l2_pages in (list(range(m)), list(range(0, 2 * m, 2))):

                    def run(
                        e: TransferEngine = e, d: str = direction, q: list[int] = l2_pages, o: list[int] = l1_pages
                    ) -> None:
                        t = e.d2h(o, q) if d == "d2h" else e.h2d(q, o)
                        if not t.wait():
                            raise RuntimeError(f"{d} failed")

                    cells.append(p[direction] / wall(run, reps))
            d2h, h2d = f"{cells[0]:.3f} | {cells[1]:.3f}", f"{cells[2]:.3f} | {cells[3]:.3f}"
            print(f"  {m:>3} pages {name:<15}: d2h {d2h}   h2d {h2d}")

    if args.profile:
        engine = TransferEngine(l1, l2, "auto")
        src = layouts["consecutive"]
        engine.h2d(src, dst, events).wait()
        profiler = cProfile.Profile()
        for _ in range(20):
            torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
            ticket = profiler.runcall(engine.h2d, src, dst, events)
            ticket.wait()
        print(f"\n5. host time of 20 layered H2D enqueues of {n} consecutive pages")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
