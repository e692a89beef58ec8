"""What does a wait cost inside a CUDA graph, when it is already satisfied?

A layered forward's graph waits once per layer group. Replays of a graph of 36 "layers"
(a few small kernels each) with 9 waits, every one already satisfied: no waits, event
waits, value waits (``cuStreamWaitValue32`` nodes), and a one-program Triton kernel that
spins on the flag. Prints the median replay time of each (ms, device) over 30 replays, and the host time of
``replay()`` itself (the launch), for the plain 4-kernel layers and for 16-kernel ones.
"""

from __future__ import annotations

import statistics
import time

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


if __name__ == "__main__":
    main()
