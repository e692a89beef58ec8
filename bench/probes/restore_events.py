"""Probe: where an L2 restore's TTFT goes, without a profiler (host clocks and CUDA events).

Runs the latency bench (``bench_hicache.py``; extra flags go to it) and times the last
``--requests N`` restores of each l2 row: host moments by ``perf_counter`` from the request's
arrival (``generate``), device moments by CUDA events against one recorded on an idle stream
at arrival (so both count from the same instant, give or take a launch's few microseconds).

Host: admission, the restore's start, the H2D's call and its flush, the first DMA queued,
the layered forward's launch, the restore seen done, the first token. Device: the first DMA
begun and the last one ended (host to device), the last device-to-device row copy ended,
the forward ended. The gaps between them are the TTFT's parts: before the copy, the copy,
after the copy.

    python bench/probes/restore_events.py [--requests N] --model qwen3-8b --prefix-tokens 3500 --tiers l2
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/probes/
import bench_hicache
from common import with_defaults
from restore_timeline import HOST  # the same host phases as the profiled timeline

from hicache.backends import dma
from hicache.engine.engine import Engine


class Request:
    """The marks of one timed request."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.host: dict[str, list[float]] = {}  # label -> [first entry, last exit] ms
        self.events: dict[str, Any] = {}  # label -> CUDA event (its last record)
        self.anchor: Any = None

    def enter(self, label: str) -> None:
        now = (time.perf_counter() - self.t0) * 1e3
        self.host.setdefault(label, [now, now])

    def leave(self, label: str) -> None:
        self.host[label][1] = (time.perf_counter() - self.t0) * 1e3

    def record(self, label: str, stream: Any, first_only: bool = False) -> None:
        if first_only and label in self.events:
            return
        event = self.events.get(label)
        if event is None:
            event = self.events[label] = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(stream)


current: list[Request] = []


def wrap_host(owner: Any, name: str, label: str) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        req = current[0] if current else None
        if req is not None:
            req.enter(label)
        try:
            return fn(*args, **kwargs)
        finally:
            if req is not None:
                req.leave(label)

    setattr(owner, name, wrapper)


def wrap_dma(name: str, label: str, stream_at: int) -> None:
    fn: Callable[..., Any] = getattr(dma, name)

    def wrapper(*args: Any) -> Any:
        req = current[0] if current else None
        if req is None:
            return fn(*args)
        stream = args[stream_at]  # a torch stream (dma's functions take one)
        req.record(f"{label} first begun", stream, first_only=True)
        req.enter(f"{label} queued")
        out = fn(*args)
        req.leave(f"{label} queued")
        req.record(f"{label} last ended", stream)
        return out

    setattr(dma, name, wrapper)


def main(argv: list[str]) -> None:
    count = 3
    if argv[:1] == ["--requests"]:
        count, argv = int(argv[1]), argv[2:]
    for (owner, name), label in HOST.items():
        wrap_host(owner, name, label)
    wrap_dma("copy_rows_raw", "H2D DMA", 6)
    wrap_dma("copy_rows_device", "D2D DMA", 6)
    launch = Engine._launch_forward

    def launch_forward(self: Engine, *args: Any, **kwargs: Any) -> Any:
        out = launch(self, *args, **kwargs)
        if current:
            current[0].record("forward ended", self.runner._side)
        return out

    Engine._launch_forward = launch_forward  # type: ignore[method-assign]
    generate = Engine.generate
    seen = [0]
    total = 2 * (8 + 2)  # the bench's defaults: (warm-up + iterations) alternations
    done: list[tuple[float, dict[str, list[float]], dict[str, float]]] = []
    idle = torch.cuda.Stream() if torch.cuda.is_available() else None  # type: ignore[no-untyped-call]

    def timed(self: Engine, prompt: list[int], max_new_tokens: int = 1) -> Any:
        if not self.enabled or seen[0] >= total:
            return generate(self, prompt, max_new_tokens)
        seen[0] += 1
        if seen[0] <= total - count or idle is None:
            return generate(self, prompt, max_new_tokens)
        torch.cuda.synchronize()
        req = Request()
        anchor = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        req.t0 = time.perf_counter()
        anchor.record(idle)
        current.append(req)
        try:
            out = generate(self, prompt, max_new_tokens)
        finally:
            current.clear()
        torch.cuda.synchronize()
        device = {label: float(anchor.elapsed_time(e)) for label, e in req.events.items()}
        done.append((out.ttft_s * 1e3, req.host, device))
        return out

    Engine.generate = timed  # type: ignore[method-assign]
    bench_hicache.main(with_defaults(["--iterations", "8", "--warmup", "2"], argv))
    for i, (ttft, host, device) in enumerate(done):
        print(f"\nrestore {i}: TTFT {ttft:.3f} ms (ms from arrival; host by perf_counter, device by CUDA events)")
        marks = [(a, f"host   {label:<22} {a:8.3f} .. {b:8.3f}") for label, (a, b) in host.items()]
        marks += [(t, f"device {label:<22} {t:8.3f}") for label, t in device.items()]
        for _, line in sorted(marks):
            print("  " + line)
    if done:
        print("\nmedians over the timed restores (ms from arrival):")
        print(f"  TTFT {statistics.median(t for t, _, _ in done):.3f}")
        for label in done[0][2]:
            print(f"  device {label:<22} {statistics.median(d[label] for _, _, d in done if label in d):8.3f}")
        for label in done[0][1]:
            vals = [h[label] for _, h, _ in done if label in h]
            print(
                f"  host   {label:<22} {statistics.median(v[0] for v in vals):8.3f} .. "
                f"{statistics.median(v[1] for v in vals):8.3f}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
