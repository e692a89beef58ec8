"""Probe: where an L2 restore's TTFT goes, by the host's clock, without a profiler.

Runs the latency bench (``bench_hicache.py``; extra flags go to it) with light wrappers
(one ``perf_counter`` call each) around the calls a restore makes, and prints for the
last ``--last N`` restored requests the time from submission to each phase (ms): the first
step, admission and planning, the restore's start, the first and last host-to-device DMA
queued, the layered forward's launch, the wait for the GPU, the restore's completion and
the first token. ``copy end`` is the first DMA's queuing plus the H2D's service (CUDA
events around it), so ``tail`` (TTFT less copy end) is what the request took after the
copy: the forward's last groups, the LM head, the first token's read-back and the host's
steps. A profiler adds milliseconds of its own to this path; these wrappers a few µs.

    python bench/probes/restore_phases.py [--last N] --model qwen3-8b --prefix-tokens 3500 --tiers l2
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import bench_hicache

from hicache.backends import dma
from hicache.backends.transfer import TransferEngine
from hicache.engine.engine import Engine
from hicache.engine.model import ModelRunner
from hicache.facade import HiCache

clock = time.perf_counter
current: dict[str, float] | None = None  # the request being traced: phase -> first time (s)
counts: dict[str, int] = {}


def stamp(label: str, *, last: bool = False) -> None:
    if current is None:
        return
    now = clock()
    if last or label not in current:
        current[label] = now
    counts[label] = counts.get(label, 0) + 1


def wrap(owner: Any, name: str, label: str) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stamp(f"{label} <")
        try:
            return fn(*args, **kwargs)
        finally:
            stamp(f"{label} >", last=True)

    setattr(owner, name, wrapper)


PHASES = [
    ("step <", "first step"),
    ("admit <", "admit"),
    ("plan >", "planned"),
    ("start_restore <", "start restore"),
    ("h2d <", "h2d call"),
    ("flush <", "flush"),
    ("dma <", "first DMA queued"),
    ("dma >", "last DMA queued"),
    ("d2d <", "first row copy queued"),
    ("launch <", "launch forward"),
    ("launch >", "forward launched"),
    ("start_restore >", "restore started"),
    ("wait <", "wait layered"),
    ("poll >", "last poll"),
    ("restored <", "restored"),
    ("first token <", "first token"),
]


FINE = [
    ("HiRadixTree", "match_prefixes"),
    ("Controller", "_commit"),
    ("CacheCore", "start"),
    ("Controller", "_make_room"),
    ("PageAllocator", "free"),
    ("PageAllocator", "allocate"),
    ("Controller", "_prefix_after"),
    ("TransferEngine", "_order"),
    ("TransferEngine", "_plan"),
    ("TransferEngine", "_straight_plan"),
    ("TransferEngine", "_d2d_plan"),
    ("TransferEngine", "_issue"),
    ("TransferEngine", "_wait_caller"),
    ("TransferEngine", "_layered_copies"),
    ("TransferEngine", "_layer_dmas"),
]


def main(argv: list[str]) -> None:
    global current
    keep = 8
    if argv[:1] == ["--last"]:
        keep, argv = int(argv[1]), argv[2:]
    fine = argv[:1] == ["--fine"]  # every wrapped call's first entry and last exit, in order
    argv = argv[fine:]
    if fine:
        from hicache.core.allocator import PageAllocator
        from hicache.core.cache import CacheCore
        from hicache.core.controller import Controller
        from hicache.core.tree import HiRadixTree

        owners: dict[str, Any] = {
            "CacheCore": CacheCore,
            "Controller": Controller,
            "HiRadixTree": HiRadixTree,
            "PageAllocator": PageAllocator,
            "TransferEngine": TransferEngine,
        }
        for owner, name in FINE:
            wrap(owners[owner], name, f"{owner}.{name}")
    wrap(Engine, "step", "step")
    wrap(HiCache, "admit", "admit")
    wrap(HiCache, "plan", "plan")
    wrap(HiCache, "start_restore", "start_restore")
    wrap(HiCache, "poll", "poll")
    wrap(TransferEngine, "h2d", "h2d")
    wrap(TransferEngine, "flush", "flush")
    wrap(dma, "copy_rows_raw", "dma")
    wrap(dma, "copy_rows_device", "d2d")
    wrap(Engine, "_launch_forward", "launch")
    wrap(ModelRunner, "wait_layered", "wait")
    wrap(Engine, "_restored", "restored")
    wrap(Engine, "_first_token", "first token")
    generate = Engine.generate
    traces: list[dict[str, float]] = []
    tickets: list[Any] = []
    h2d = TransferEngine.h2d

    def keep_ticket(self: TransferEngine, *args: Any, **kwargs: Any) -> Any:
        ticket = h2d(self, *args, **kwargs)
        if current is not None:
            tickets.append(ticket)
        return ticket

    TransferEngine.h2d = keep_ticket  # type: ignore[method-assign]

    def traced(self: Engine, prompt: list[int], max_new_tokens: int = 1) -> Any:
        global current
        if not self.enabled:
            return generate(self, prompt, max_new_tokens)
        current, t0 = {}, clock()
        counts.clear()
        tickets.clear()
        try:
            out = generate(self, prompt, max_new_tokens)
        finally:
            trace, current = current, None
        if out.restored_from == "L2" and trace is not None:
            trace = {k: (v - t0) * 1e3 for k, v in trace.items()}
            trace["ttft"] = out.ttft_s * 1e3
            trace["dmas"] = counts.get("dma <", 0)
            trace["row copies"] = counts.get("d2d <", 0)
            service = [t.timings.service_s for t in tickets if t.pages > 1]
            trace["service"] = service[0] * 1e3 if service else float("nan")
            if "dma <" in trace:
                trace["copy end"] = trace["dma <"] + trace["service"]
                trace["tail"] = trace["ttft"] - trace["copy end"]
            traces.append(trace)
        return out

    Engine.generate = traced  # type: ignore[method-assign]
    bench_hicache.main(argv)
    rows = traces[-keep:]
    if not rows:
        print("no L2 restores traced")
        return
    print(f"\n# ms from submission, median of the last {len(rows)} L2 restores (min .. max)")
    for key, label in PHASES:
        values = [r[key] for r in rows if key in r]
        if values:
            print(f"{label:<24} {statistics.median(values):8.3f}  ({min(values):.3f} .. {max(values):.3f})")
    if fine:
        stamps = {k for r in rows for k in r if k.endswith(("<", ">"))}
        keys = sorted(stamps, key=lambda k: statistics.median(r[k] for r in rows if k in r))
        print("\n# every wrapped call: first entry (<) and last exit (>)")
        for key in keys:
            values = [r[key] for r in rows if key in r]
            print(f"{key:<36} {statistics.median(values):8.3f}  ({min(values):.3f} .. {max(values):.3f})")
    for key in ("service", "copy end", "ttft", "tail", "dmas", "row copies"):
        values = [r[key] for r in rows if key in r]
        if values:
            print(f"{key:<24} {statistics.median(values):8.3f}  ({min(values):.3f} .. {max(values):.3f})")


if __name__ == "__main__":
    main(sys.argv[1:])
