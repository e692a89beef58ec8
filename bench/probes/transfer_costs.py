"""Probe: where a small transfer's host time goes, and how the ring's chunk size moves a
64-page transfer. A probe, run by hand on a GPU machine (with ``bench/`` on the path):

    python bench/probes/transfer_costs.py [--reps 30] [--small 1 4 16] [--ring 64 256]

``small``: per size, the wall time of the engine's D2H and H2D against a plain pinned copy
of the same bytes and against the bare DMAs the copy path queues (one strided
``cudaMemcpy2DAsync`` per page and an event), samples of the three interleaved; then the
host cost of each call the engine makes around those DMAs, each in a loop of its own.

``ring``: per size, engines whose ring chunks are 32, 64, 128 and 256 MiB (and heads of 0,
8 and 16 pages for a D2H), samples interleaved, each as a ratio to the plain copy, with
the median device service of its tickets.
"""

# ruff: noqa: B023  (every closure below is called before its loop moves on)
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from transfer import QWEN3_8B

from hicache.backends import dma
from hicache.backends.pools import DevicePool, HostPool, check_pages
from hicache.backends.ticket import Ticket
from hicache.backends.transfer import DeviceTicket, TransferEngine
from hicache.spec.model import Direction

G = QWEN3_8B
MIB = 1 << 20


def interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median wall ms of each of ``fns`` (each must finish its GPU work), one sample of
    each in turn per repetition, after one warm-up round."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps + 1):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i:
                samples[k].append(dt * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def per_call_us(fn: Callable[[], Any], n: int = 2000) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def small(l1: DevicePool, l2: HostPool, sizes: list[int], reps: int) -> None:
    e = TransferEngine(l1, l2, "auto")
    stream = e.stream
    plain_dev = torch.empty(max(sizes) * G.bytes_per_page, dtype=torch.uint8, device="cuda")
    plain_host = torch.empty_like(plain_dev, device="cpu").pin_memory()
    end: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
    for n in sizes:
        nbytes = n * G.bytes_per_page
        src, dst, l2p = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2)), list(range(n))

        def plain(d2h: bool) -> None:
            if d2h:
                plain_host[:nbytes].copy_(plain_dev[:nbytes], non_blocking=True)
            else:
                plain_dev[:nbytes].copy_(plain_host[:nbytes], non_blocking=True)
            torch.cuda.synchronize()

        def bare(d2h: bool) -> None:
            pairs = list(zip(l2p, src, strict=True)) if d2h else list(zip(dst, l2p, strict=True))
            e._copy_pairs(d2h, pairs)
            end.record(stream)
            end.synchronize()

        def engine(d2h: bool) -> None:
            t = e.d2h(src, l2p) if d2h else e.h2d(l2p, dst)
            assert t.wait(), t.error

        fns = {
            "plain d2h": lambda: plain(True),
            "bare d2h": lambda: bare(True),
            "engine d2h": lambda: engine(True),
            "plain h2d": lambda: plain(False),
            "bare h2d": lambda: bare(False),
            "engine h2d": lambda: engine(False),
        }
        med = interleaved(fns, reps)
        cells = "  ".join(f"{k} {v:.3f}" for k, v in med.items())
        print(f"{n:>4} pages ({nbytes / MIB:.1f} MiB), median wall ms: {cells}")
        for d in ("d2h", "h2d"):
            p = med[f"plain {d}"]
            print(f"     {d}: bare / plain {p / med[f'bare {d}']:.3f}, engine / plain {p / med[f'engine {d}']:.3f}")

    n = 4
    src, l2p = list(range(0, 2 * n, 2)), list(range(n))
    dev = l1.device
    cur = torch.cuda.current_stream(dev)
    ev: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(cur)
    width = G.page_elements * l1.buffer.element_size()
    rt: Any = getattr(dma, "_rt", None)
    tickets: list[Ticket] = []

    def check_both() -> None:
        check_pages("L1", src, l1.num_pages)
        check_pages("L2", l2p, l2.num_pages)

    def enqueue() -> None:
        tickets.append(e.d2h(src, l2p))

    parts: dict[str, Callable[[], Any]] = {
        "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
        "torch._C._cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(dev.index or 0),
        "stream.wait_stream(current)": lambda: stream.wait_stream(cur),
        "stream.wait_event(event)": lambda: stream.wait_event(ev),
        "event.record(stream)": lambda: ev.record(stream),
        "cudaEventRecord (cuda-python)": lambda: rt.cudaEventRecord(ev.cuda_event, stream.cuda_stream),
        "cudaStreamWaitEvent (cuda-python)": lambda: rt.cudaStreamWaitEvent(stream.cuda_stream, ev.cuda_event, 0),
        "cudaMemcpy2DAsync, 1 row of 64 B": lambda: rt.cudaMemcpy2DAsync(
            l2.slabs.data_ptr(), width, l1.slabs.data_ptr(), width, 64, 1, dma._ANY, stream.cuda_stream
        ),
        "l1.buffer.untyped_storage()": lambda: l1.buffer.untyped_storage().data_ptr(),
        "check_pages x2": check_both,
        "DeviceTicket(...)": lambda: DeviceTicket(Direction.D2H, n, n * G.bytes_per_page),
        "fences.pending x2": lambda: (l1.fences.pending(src, exclude=e), l2.fences.pending(l2p, write=True, exclude=e)),
        "e._plan": lambda: e._plan(n, l2p, False),
        "e.faults.take": lambda: e.faults.take("write", ("fail", "slow")),
        "e.flush (nothing deferred)": e.flush,
        "e._timer + put back": lambda: e._timers.append(e._timer()),
        "event.elapsed_time": lambda: ev.elapsed_time(ev),
        "enqueue: e.d2h (4 pages, no wait)": enqueue,
    }
    print(f"\nhost cost per call (us), {n} pages where it applies:")
    for name, fn in parts.items():
        try:
            us = per_call_us(fn, 500 if name.startswith("enqueue") else 2000)
        except Exception as exc:  # a call this runtime lacks: say so, go on
            print(f"  {name:<42} failed: {exc!r}")
            continue
        torch.cuda.synchronize()
        if tickets:
            t0 = time.perf_counter()
            for t in tickets:
                t.wait()
            waited = (time.perf_counter() - t0) / len(tickets) * 1e6
            tickets.clear()
            print(f"  {name:<42} {us:8.2f}   (then ticket.wait on a finished copy: {waited:.2f})")
        else:
            print(f"  {name:<42} {us:8.2f}")


def ring(l1: DevicePool, l2: HostPool, sizes: list[int], reps: int) -> None:
    engines = {
        f"chunk {c} MiB": TransferEngine(l1, l2, "auto", chunk_bytes=c * MIB, copy_max_pages=0, direct_max_bytes=0)
        for c in (32, 64, 128, 256)
    }
    for h in (0, 16):
        engines[f"chunk 64 MiB head {h}"] = TransferEngine(
            l1, l2, "auto", ring_head_pages=h, copy_max_pages=0, direct_max_bytes=0
        )
    plain_dev = torch.empty(max(sizes) * G.bytes_per_page, dtype=torch.uint8, device="cuda")
    plain_host = torch.empty_like(plain_dev, device="cpu").pin_memory()
    for n in sizes:
        nbytes = n * G.bytes_per_page
        src, dst = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
        for layout, l2p in (("consecutive", list(range(n))), ("fragmented", list(range(0, 2 * n, 2)))):
            for d2h in (True, False):
                service: dict[str, list[float]] = {}

                def plain(d2h: bool = d2h) -> None:
                    if d2h:
                        plain_host[:nbytes].copy_(plain_dev[:nbytes], non_blocking=True)
                    else:
                        plain_dev[:nbytes].copy_(plain_host[:nbytes], non_blocking=True)
                    torch.cuda.synchronize()

                fns: dict[str, Callable[[], Any]] = {"plain": plain}
                for name, e in engines.items():
                    if not d2h and "head" in name:
                        continue

                    def run(e: TransferEngine = e, name: str = name, d2h: bool = d2h, l2p: list[int] = l2p) -> None:
                        t = e.d2h(src, l2p) if d2h else e.h2d(l2p, dst)
                        assert t.wait(), t.error
                        service.setdefault(name, []).append(t.timings.service_s * 1e3)

                    fns[name] = run
                med = interleaved(fns, reps)
                p = med.pop("plain")
                cells = "  ".join(
                    f"{k}: {p / v:.3f} ({statistics.median(service[k]):.3f} ms svc)" for k, v in med.items()
                )
                print(f"{n:>4} pages {layout:<11} {'D2H' if d2h else 'H2D'}: plain {p:.3f} ms; {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--small", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--ring", type=int, nargs="*", default=[64, 256])
    args = ap.parse_args()
    top = max([*args.small, *args.ring, 1])
    l1 = DevicePool.allocate(G, 2 * top + 8, "cuda")
    l2 = HostPool(G, 2 * top + 8, pin=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {when}")
    if args.small:
        small(l1, l2, args.small, args.reps)
    if args.ring:
        print()
        ring(l1, l2, args.ring, args.reps)


if __name__ == "__main__":
    main()
