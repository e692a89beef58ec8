"""What does a wait cost inside a CUDA graph: satisfied, and pending?

A layered forward's graph waits once per layer group. Replays of a graph of 36 "layers"
(a few small kernels each) with 9 waits: no waits, event waits, value waits
(``cuStreamWaitValue32`` nodes), and a one-program Triton kernel that spins on the flag.

1. Every wait already satisfied: the median replay time of each (ms, device) over 30
   replays, and the host time of ``replay()`` itself (the launch), for 4- and 16-kernel layers.
2. Pending: a producer stream releases group g after ``(g + 1) * 0.4`` ms (a sleep, then the
   record or write), as a copy would; events are recorded before the graph is launched (they
   must be), value and spin waits after it (the point of them). Prints the median time from
   the producer's last release to the graph's end (ms), against the same graph's work after
   its last wait, satisfied: the difference is what releasing costs. A graph still waiting
   after 5 s is reported (with how long its ``replay()`` held the host) and drained.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import torch
import triton
import triton.language as tl

from hicache.backends import dma


@triton.jit
def _spin(flag_ptr, target):  # type: ignore[no-untyped-def]
    while tl.load(flag_ptr, volatile=True) < target:
        pass


def main() -> None:
    dev = torch.device("cuda")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    flags = torch.ones(9, dtype=torch.int32, device=dev)
    events = [torch.cuda.Event(external=True) for _ in range(9)]  # type: ignore[no-untyped-call]
    for e in events:
        e.record(side)
    groups = [0, 1, 3, 7, 15, 21, 29, 33, 35]

    def body(kind: str, per: int = 4) -> None:
        y = x
        for layer in range(36):
            if layer in groups:
                g = groups.index(layer)
                if kind == "event":
                    side.wait_event(events[g])
                elif kind == "value":
                    dma.wait_value(side, flags.data_ptr() + 4 * g, 1)
                elif kind == "spin":
                    _spin[(1,)](flags[g:], 1)
            for _ in range(per):
                y = torch.nn.functional.silu(y @ w[:, :4096])[:, :4096]

    for per in (4, 16):
        for kind in ("none", "event", "value", "spin"):
            with torch.cuda.stream(side):
                body(kind, per)  # warm-up (compiles)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                body(kind, per)
            times, hosts = [], []
            for _ in range(30):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                with torch.cuda.stream(side):
                    a.record(side)
                    t0 = time.perf_counter()
                    g.replay()
                    hosts.append(time.perf_counter() - t0)
                    b.record(side)
                b.synchronize()
                times.append(a.elapsed_time(b))
            print(
                f"{per:2d} kernels/layer {kind:6s} replay median {statistics.median(times):.3f} ms "
                f"(min {min(times):.3f}); launch (host) median {statistics.median(hosts) * 1e3:.3f} ms"
            )
    pending(side, body, flags, events)


DEADLINE_S = 5.0


def watchdog(flags: torch.Tensor) -> tuple[threading.Timer, list[bool]]:
    """A timer that, after :data:`DEADLINE_S`, sets every flag from a stream of its own
    (nothing queued ahead of it) so a stuck graph drains, even while the host is held inside
    ``replay()``; its list says whether it fired."""
    fired: list[bool] = []

    def unblock() -> None:
        fired.append(True)
        with torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]
            flags.fill_(1)

    timer = threading.Timer(DEADLINE_S, unblock)
    timer.start()
    return timer, fired


def pending(side: torch.cuda.Stream, body: object, flags: torch.Tensor, events: list[Any]) -> None:
    """Section 2 of the module docstring."""
    producer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    cycles = int(0.4e-3 * 1.98e9)  # ~0.4 ms at ~1.98 GHz

    def release(kind: str, last: torch.cuda.Event) -> None:
        for g in range(9):
            with torch.cuda.stream(producer):
                torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
            if kind == "event":
                events[g].record(producer)
            else:
                dma.write_value(producer, flags.data_ptr() + 4 * g, 1)
        last.record(producer)

    for kind in ("event", "value", "spin"):
        with torch.cuda.stream(side):
            body(kind)  # type: ignore[operator]
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            body(kind)  # type: ignore[operator]
        tails: list[float] = []
        for _ in range(20):
            flags.zero_()
            torch.cuda.synchronize()
            last = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            if kind == "event":
                release(kind, last)
            timer, fired = watchdog(flags)
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                g.replay()
                end.record(side)
            held = time.perf_counter() - t0
            if kind != "event":
                release(kind, last)
            end.synchronize()
            timer.cancel()
            if fired:
                print(f"pending {kind:6s} still waiting after {DEADLINE_S:.0f} s (replay() took {held * 1e3:.1f} ms)")
                torch.cuda.synchronize()
                break
            tails.append(last.elapsed_time(end))
        if tails:
            print(f"pending {kind:6s} last release -> graph end median {statistics.median(tails):.3f} ms")
    flags.fill_(1)


if __name__ == "__main__":
    main()
