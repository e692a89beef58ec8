"""Probe: ways to load a restore layer by layer (H2D), against a plain pinned copy.

L2 is page-major, so one layer's data is 2n strided pieces of n pages. For the Qwen3-8B
geometry and ``--pages`` pages it measures GiB/s and the ratio to one pinned ``copy_`` for:
DMA + scatter (the transfer engine's whole-run path), ``kernels.load_layers_triton``
zero-copy (all layers, per layer, with capped grids) and per-layer strided DMAs
(``dma.copy_rows``) + scatter; checks every page bit-identical; and measures how much each
per-layer way on a side stream slows a memory-bound matmul loop. Needs CUDA.

    python bench/probes/layer_load.py --pages 219 1024
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the transfer bench's geometry
from transfer import QWEN3_8B, gpu

from hicache.backends import dma, kernels
from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.transfer import TransferEngine


def dma_scatter(host: torch.Tensor, packed: torch.Tensor, dst_ids: torch.Tensor, l1_slabs: torch.Tensor) -> None:
    """What the transfer engine does for one run of L2 pages: one DMA, one scatter."""
    packed.copy_(host, non_blocking=True)
    kernels.scatter_triton(packed, dst_ids, l1_slabs)


def zero_copy(
    l2_slabs: torch.Tensor,
    src_ids: torch.Tensor,
    l1_slabs: torch.Tensor,
    dst_ids: torch.Tensor,
    ranges: list[tuple[int, int]],
    programs: int | None = None,
) -> None:
    """One zero-copy launch per layer range."""
    for r in ranges:
        kernels.load_layers_triton(l2_slabs, src_ids, l1_slabs, dst_ids, r, programs=programs)


def dma_rows(
    host: torch.Tensor,
    packed: torch.Tensor,
    ids: torch.Tensor,
    dst_ids: torch.Tensor,
    l1_slabs: torch.Tensor,
    ranges: list[tuple[int, int]],
) -> None:
    """Per layer range: two strided DMAs (its K and V slabs of every page), one scatter."""
    half = host.shape[1] // 2
    stream = torch.cuda.current_stream()
    for lo, hi in ranges:
        for base in (0, half):
            dma.copy_rows(
                packed[:, base + lo : base + hi].flatten(1), host[:, base + lo : base + hi].flatten(1), stream
            )
        kernels.load_layers_triton(packed, ids, l1_slabs, dst_ids, (lo, hi))


def host_ms(fn: Any, reps: int) -> float:
    """Median host milliseconds to enqueue ``fn`` (the device drained after each)."""
    samples = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        ticket = fn()
        samples.append(time.perf_counter() - t0)
        if hasattr(ticket, "wait"):  # a transfer's ticket: finish it (frees its workspace)
            ticket.wait()
        torch.cuda.synchronize()
    return statistics.median(samples[1:]) * 1e3


def enqueue_costs(l1: DevicePool, l2: HostPool, n: int, reps: int) -> dict[str, float]:
    """Host time to enqueue one layered H2D of ``n`` pages (the request's forward launches
    only after it), by layer group, and of its parts."""
    g = l1.geometry
    layers = g.num_layers
    events: list[Any] = [torch.cuda.Event() for _ in range(layers)]  # type: ignore[no-untyped-call]
    src, dst = list(range(n)), list(range(n, 2 * n))
    out: dict[str, float] = {}
    for first, most in ((1, 1), (2, 2), (4, 4), (1, 8)):
        engine = TransferEngine(l1, l2, "triton", layer_group=first, max_layer_group=most)
        label = f"{first} layer(s) a step" if first == most else f"{first} doubling to {most}"
        out[f"layered h2d, {label}"] = host_ms(partial(engine.h2d, src, dst, events), reps)
        out.setdefault("h2d, not layered", host_ms(partial(engine.h2d, src, dst), reps))
    host = l2.slabs[:n]
    packed = torch.empty(host.shape, dtype=host.dtype, device="cuda")
    ids = torch.arange(n, device="cuda")
    stream = torch.cuda.current_stream()

    def rows() -> None:
        for x in range(layers):
            dma.copy_rows(packed[:, x], host[:, x], stream)

    def scatters() -> None:
        for x in range(0, layers, 2):
            kernels.load_layers_triton(packed, ids, l1.slabs, ids, (x, x + 2), programs=32)

    out["36 copy_rows"] = host_ms(rows, reps)
    out["18 load_layers_triton"] = host_ms(scatters, reps)
    out["36 event records"] = host_ms(lambda: [e.record() for e in events], reps)
    print(f"\nhost ms to enqueue, {n} pages: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
    # Does a graph's external event wait see a record made after the graph's launch?
    x = torch.zeros(1024, device="cuda")
    y = torch.zeros(1024, device="cuda")
    ev = torch.cuda.Event(external=True)  # type: ignore[no-untyped-call]
    ev.record()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ev.wait(torch.cuda.current_stream())
        y.copy_(x)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    gate = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(gate):
        torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
    torch.cuda.current_stream().wait_stream(gate)  # the graph starts ~25 ms from now
    graph.replay()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]
        x.fill_(1.0)
        ev.record()
    torch.cuda.synchronize()
    later = bool(y[0].item() == 1.0)
    print(f"graph event wait node sees a record made after launch (before it ran): {later}")
    out["wait_node_sees_later_record"] = float(later)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, nargs="+", default=[219, 1024], help="219 pages = 3,500 tokens")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("HICACHE_BENCH_OUT", "/tmp/hicache-bench")))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    g = QWEN3_8B
    most = max(args.pages)
    l2 = HostPool(g, 2 * most)
    l2.slabs.view(torch.int16).random_(-(2**15), 2**15 - 1)
    l1 = DevicePool.allocate(g, 2 * most, "cuda")
    layers = g.num_layers
    rows: list[dict[str, Any]] = []
    print(f"Qwen3-8B KV, {torch.cuda.get_device_name()}, {date.today()}; {g.bytes_per_page / 2**20:.2f} MiB per page")
    print(f"{'pages':>6} {'way':<24} {'ms':>8} {'GiB/s':>8} {'vs pinned copy':>15}")
    for n in args.pages:
        nbytes = n * g.bytes_per_page
        src_ids = torch.arange(most - n // 2, most - n // 2 + n, device="cuda")  # one L2 run
        dst_ids = torch.randperm(2 * most, device="cuda")[:n]  # scattered L1 pages
        host = l2.slabs[most - n // 2 : most - n // 2 + n]
        packed = torch.empty(host.shape, dtype=host.dtype, device="cuda")

        all_layers, each_layer = [(0, layers)], [(x, x + 1) for x in range(layers)]
        pairs = [(x, x + 2) for x in range(0, layers, 2)]
        ids = torch.arange(n, device="cuda")
        base = None
        ways: list[tuple[str, Any]] = [
            ("pinned copy", partial(packed.copy_, host, non_blocking=True)),
            ("DMA + scatter", partial(dma_scatter, host, packed, dst_ids, l1.slabs)),
            ("zero-copy, all layers", partial(zero_copy, l2.slabs, src_ids, l1.slabs, dst_ids, all_layers)),
            ("zero-copy, per layer", partial(zero_copy, l2.slabs, src_ids, l1.slabs, dst_ids, each_layer)),
            ("zero-copy/layer, 16 prog", partial(zero_copy, l2.slabs, src_ids, l1.slabs, dst_ids, each_layer, 16)),
            ("zero-copy/layer, 32 prog", partial(zero_copy, l2.slabs, src_ids, l1.slabs, dst_ids, each_layer, 32)),
        ]
        if dma.AVAILABLE:
            ways.append(
                ("DMA rows/layer + scatter", partial(dma_rows, host, packed, ids, dst_ids, l1.slabs, each_layer))
            )
            ways.append(("DMA rows/2 layers + sc.", partial(dma_rows, host, packed, ids, dst_ids, l1.slabs, pairs)))
        for way, fn in ways:
            l1.slabs.zero_()
            s = gpu(fn, args.reps)
            base = base or s
            if way != "pinned copy":  # every loaded page bit-identical to its L2 page
                got = l1.slabs.index_select(1, dst_ids).transpose(0, 1).cpu()
                ok = torch.equal(got.view(torch.int16), host.view(torch.int16))
            else:
                ok = torch.equal(packed.cpu().view(torch.int16), host.view(torch.int16))
            row = {"pages": n, "way": way, "ms": s * 1e3, "gib_per_s": nbytes / s / 2**30, "vs_pinned": base / s}
            row["bit_identical"] = ok
            rows.append(row)
            flag = "" if ok else "  PAGES DIFFER"
            print(f"{n:>6} {way:<24} {s * 1e3:>8.3f} {nbytes / s / 2**30:>8.1f} {base / s:>14.2f}x{flag}")
    # interference: a matmul loop alone, then with per-layer zero-copy loads on a side stream
    n = args.pages[0]
    src_ids = torch.arange(n, device="cuda")
    dst_ids = torch.arange(n, device="cuda")
    # like a restored tail's forward: 22 tokens through weights streamed from HBM (memory-bound)
    x = torch.randn(22, 4096, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(4096, 12288, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def compute() -> None:
        for i in range(400):
            x @ weights[i % 4]

    each = [(x, x + 1) for x in range(layers)]
    host = l2.slabs[:n]
    packed = torch.empty(host.shape, dtype=host.dtype, device="cuda")
    loads: list[tuple[str, Any]] = [
        ("zero-copy", partial(zero_copy, l2.slabs, src_ids, l1.slabs, dst_ids, each)),
        ("zero-copy 16 prog", partial(zero_copy, l2.slabs, src_ids, l1.slabs, dst_ids, each, 16)),
        ("zero-copy 32 prog", partial(zero_copy, l2.slabs, src_ids, l1.slabs, dst_ids, each, 32)),
    ]
    if dma.AVAILABLE:
        loads.append(("DMA rows + scatter", partial(dma_rows, host, packed, src_ids, dst_ids, l1.slabs, each)))
    overlap = []
    alone = gpu(compute, args.reps)
    print(f"\noverlap, {n} pages loaded per layer on a side stream beside a matmul loop ({alone * 1e3:.2f} ms alone)")
    for name, load_each in loads:

        def both() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                load_each()  # noqa: B023 - called before the loop moves on
            compute()
            torch.cuda.current_stream().wait_stream(side)

        together, load = gpu(both, args.reps), gpu(load_each, args.reps)
        hidden = (alone + load - together) / min(alone, load)
        overlap.append({"way": name, "compute_ms": alone * 1e3, "load_ms": load * 1e3, "both_ms": together * 1e3})
        print(f"  {name:<20} load {load * 1e3:6.2f} ms alone, both {together * 1e3:6.2f} ms ({hidden:.0%} hidden)")
    enqueue = enqueue_costs(l1, l2, n, args.reps)
    result = {
        "date": str(date.today()),
        "device": torch.cuda.get_device_name(),
        "rows": rows,
        "overlap": overlap,
        "enqueue_ms": enqueue,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"layer_load-{date.today()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
