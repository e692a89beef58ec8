"""Probe: the timeline of one L2 restore, host and device, from a profiler trace.

Runs the latency bench (``bench_hicache.py``; extra flags go to it) and profiles a few of
its timed restores (``--profile N``, the last N requests of the first l2 row). For each: the
host phases of the request (admission, the restore's start, the H2D's queuing, the layered
forward's launch, the wait, the first token) and, per CUDA stream, when its work began and
ended and how long it sat idle in between (ms from the request's arrival). The forward's
idle gaps say where it waited for the copy; the copy stream's, where the host fed it late.
Traces go to ``--trace-dir`` when given; ``--gpu-only`` records CUDA activity and API calls only
(less overhead on the host: times from the request's first CUDA call, no host phases). On a CPU, the host phases only.

    python bench/probes/restore_timeline.py [--profile N] [--trace-dir D] [--gpu-only] \\
        --model qwen3-8b --prefix-tokens 3500 --tiers l2
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import bench_hicache
from common import with_defaults

from hicache.backends.transfer import TransferEngine
from hicache.engine.engine import Engine
from hicache.engine.model import ModelRunner

HOST = {
    (Engine, "_admit"): "admit",
    (Engine, "_start_restore"): "start restore",
    (TransferEngine, "h2d"): "h2d call",
    (TransferEngine, "flush"): "flush",
    (Engine, "_launch_forward"): "launch forward",
    (ModelRunner, "wait_layered"): "wait layered",
    (Engine, "_restored"): "restored",
    (Engine, "_first_token"): "first token",
}


def annotate(owner: Any, name: str, label: str) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"probe: {label}"):
            return fn(*args, **kwargs)

    setattr(owner, name, wrapper)


def summarize(trace: dict[str, Any], ttft_ms: float) -> dict[str, Any]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    request = next((e for e in events if e.get("name") == "probe: request"), None)
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    # without the host's annotations (--gpu-only): from the request's first CUDA call
    t0 = float(request["ts"] if request is not None else min(float(e["ts"]) for e in api))
    host: dict[str, list[float]] = {}
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") == "user_annotation" and name.startswith("probe: ") and name != "probe: request":
            label = name[len("probe: ") :]
            start, end = (float(e["ts"]) - t0) / 1e3, (float(e["ts"]) + float(e["dur"]) - t0) / 1e3
            if label not in host:
                host[label] = [start, end, 0.0, 0]
            host[label][1] = end
            host[label][2] += float(e["dur"]) / 1e3
            host[label][3] += 1
    calls: dict[str, list[float]] = {}
    for e in api:
        start, end = (float(e["ts"]) - t0) / 1e3, (float(e["ts"]) + float(e["dur"]) - t0) / 1e3
        c = calls.setdefault(str(e["name"]), [start, end, 0.0, 0])
        c[1], c[2], c[3] = end, c[2] + float(e["dur"]) / 1e3, c[3] + 1
    streams: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            s = (float(e["ts"]) - t0) / 1e3
            if s < 0:
                continue
            streams[int(e.get("args", {}).get("stream", -1))].append((s, s + float(e["dur"]) / 1e3, str(e["cat"])))
    per_stream = {}
    for sid, spans in streams.items():
        spans.sort()
        gaps, end = [], spans[0][1]
        for start, stop, _ in spans[1:]:
            if start > end:
                gaps.append((start - end, end))
            end = max(end, stop)
        gaps.sort(reverse=True)
        kinds = collections.Counter(k for _, _, k in spans)
        per_stream[sid] = {
            "first": spans[0][0],
            "last": max(e for _, e, _ in spans),
            "busy": sum(e - s for s, e, _ in spans),
            "idle": sum(g for g, _ in gaps),
            "kinds": dict(kinds),
            "gaps": [(round(g, 3), round(at, 3)) for g, at in gaps[:4]],
        }
    return {"ttft_ms": ttft_ms, "host": host, "calls": calls, "streams": per_stream}


def main(argv: list[str]) -> None:
    count = 3
    trace_dir: Path | None = None
    if argv[:1] == ["--profile"]:
        count, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["--trace-dir"]:
        trace_dir, argv = Path(argv[1]), argv[2:]
    gpu_only = argv[:1] == ["--gpu-only"]  # no host-side recording: less overhead, no phases
    argv = argv[gpu_only:]
    for (owner, name), label in HOST.items():
        if not gpu_only:
            annotate(owner, name, label)
    generate = Engine.generate
    seen = {"l2": 0}
    summaries: list[dict[str, Any]] = []
    total = 2 * (8 + 2)  # the bench's defaults: (warm-up + iterations) alternations

    def profiled(self: Engine, prompt: list[int], max_new_tokens: int = 1) -> Any:
        if not self.enabled or seen["l2"] >= total:
            return generate(self, prompt, max_new_tokens)
        seen["l2"] += 1
        if seen["l2"] <= total - count:
            return generate(self, prompt, max_new_tokens)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        activities = ([] if gpu_only else [ProfilerActivity.CPU]) + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            with contextlib.nullcontext() if gpu_only else record_function("probe: request"):
                out = generate(self, prompt, max_new_tokens)
            if cuda:
                torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            raw = path.read_text()
        if trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            (trace_dir / f"restore-{seen['l2']}.json.gz").write_bytes(gzip.compress(raw.encode()))
        summaries.append(summarize(json.loads(raw), out.ttft_s * 1e3))
        return out

    Engine.generate = profiled  # type: ignore[method-assign]
    bench_hicache.main(with_defaults(["--iterations", "8", "--warmup", "2"], argv))
    for i, s in enumerate(summaries):
        print(f"\nrestore {i}: TTFT {s['ttft_ms']:.2f} ms (unprofiled by the host's clock, profiled here)")
        for label, (start, end, busy, n) in sorted(s["host"].items(), key=lambda kv: kv[1][0]):
            print(f"  host {label:<16} {start:7.3f} .. {end:7.3f} ms  ({n} calls, {busy:.3f} ms inside)")
        for name, (start, end, busy, n) in sorted(s["calls"].items(), key=lambda kv: -kv[1][2])[:8]:
            print(f"  call {name:<24} {start:7.3f} .. {end:7.3f} ms  ({n} calls, {busy:.3f} ms inside)")
        for sid, st in sorted(s["streams"].items(), key=lambda kv: kv[1]["first"]):
            print(
                f"  stream {sid:<4} {st['first']:7.3f} .. {st['last']:7.3f} ms  busy {st['busy']:6.3f}  "
                f"idle {st['idle']:6.3f}  {st['kinds']}  longest gaps (ms, at) {st['gaps']}"
            )
    if summaries:
        print(f"\nmedian TTFT of the profiled restores: {statistics.median(s['ttft_ms'] for s in summaries):.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
