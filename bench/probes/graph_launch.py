"""Probe: does launching a CUDA graph block the host when its stream cannot run yet?

A layered forward's graph is launched while its first kernels wait for a copy. If the
driver queues only so much work per stream, a launch of a graph with more kernels than
that returns only once enough of them ran, and the host (which should be queuing the copy
they wait for) is held. For graphs of N small kernels: the host time of ``replay()`` with
the stream idle, and with the stream held ~``--hold-ms`` by a sleep kernel queued just
before (a launch that blocks takes about the hold). Needs CUDA.

    python bench/probes/graph_launch.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def cycles_per_ms() -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    a.record()
    torch.cuda._sleep(10_000_000)  # type: ignore[no-untyped-call]
    b.record()
    b.synchronize()
    return 10_000_000 / float(a.elapsed_time(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kernels", type=int, nargs="+", default=[256, 512, 768, 900, 1000, 1100, 1300, 2048, 4096])
    ap.add_argument("--hold-ms", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    per_ms = cycles_per_ms()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    x = torch.zeros(1024, device="cuda")
    print(f"{torch.cuda.get_device_name()}: graphs of N x.add_(1) kernels; host ms of replay()")
    print(f"{'N':>6} {'idle':>8} {'held':>8}  (held: the stream sleeps {args.hold_ms} ms first)")
    for n in args.kernels:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            for _ in range(3):
                x.add_(1)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(n):
                    x.add_(1)
        times: dict[str, list[float]] = {"idle": [], "held": []}
        with torch.cuda.stream(stream):
            for _ in range(args.reps):
                for case in ("idle", "held"):
                    torch.cuda.synchronize()
                    if case == "held":
                        torch.cuda._sleep(int(args.hold_ms * per_ms))  # type: ignore[no-untyped-call]
                    t0 = time.perf_counter()
                    graph.replay()
                    times[case].append((time.perf_counter() - t0) * 1e3)
                    torch.cuda.synchronize()
        print(f"{n:>6} {statistics.median(times['idle']):8.3f} {statistics.median(times['held']):8.3f}")
        del graph


if __name__ == "__main__":
    main()
