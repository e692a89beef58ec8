"""Run a script and report where its main thread stalled: spans of at least ``--min-ms`` in
which every sample showed the same hicache/bench frame (file and line), gaps in the
sampling itself (a C call that held the GIL), each with the stack seen around it, and where
the samples fell (the innermost hicache/bench frames, with a call site each above them: a
Python loop spread over many lines shows there, not as a span).

    python bench/probes/stall_trace.py [--interval-ms 2] [--min-ms 50] -- SCRIPT [ARGS...]

The sampler is a daemon thread reading ``sys._current_frames()``; it costs the script a
GIL switch per sample. Reports go to stderr when the script exits (or fails).
"""

from __future__ import annotations

import argparse
import runpy
import sys
import threading
import time
import traceback
from collections import Counter
from types import FrameType

OURS = ("hicache/", "bench/")


def stack(frame: FrameType | None, depth: int = 80) -> list[str]:
    """Innermost first: ``file:line function`` for up to ``depth`` frames."""
    out: list[str] = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{code.co_filename.split('site-packages/')[-1]}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return out


def ours(lines: list[str]) -> str:
    """The innermost frame in our own code (the stall's place in hicache or the bench)."""
    return next((x for x in lines if any(k in x for k in OURS) and "stall_trace" not in x), lines[0] if lines else "")


class Sampler(threading.Thread):
    def __init__(self, target: int, interval_s: float, min_s: float) -> None:
        super().__init__(daemon=True)
        self.target, self.interval_s, self.min_s = target, interval_s, min_s
        self.stalls: list[tuple[float, float, str, list[str]]] = []  # (at, seconds, kind, stack)
        self.stop = threading.Event()
        self.where: Counter[tuple[str, ...]] = Counter()  # innermost frame, then 4 of ours: samples
        self.t0 = time.perf_counter()

    def run(self) -> None:
        last_t = span_start = time.perf_counter()
        last_stack: list[str] = []
        span_stack: list[str] = []
        span_key = ""
        while not self.stop.is_set():
            time.sleep(self.interval_s)
            now = time.perf_counter()
            frame = sys._current_frames().get(self.target)
            lines = stack(frame)
            if now - last_t >= self.min_s:  # the sampler itself could not run (GIL held)
                self.stalls.append((last_t - self.t0, now - last_t, "gil", [*last_stack, "-- then --", *lines]))
            key = ours(lines)
            mine = tuple(x for x in lines if any(k in x for k in OURS) and "stall_trace" not in x)[:4]
            self.where[(lines[0] if lines else "", *mine)] += 1
            if key != span_key:
                if span_key and last_t - span_start >= self.min_s:
                    self.stalls.append((span_start - self.t0, last_t - span_start, "same frame", span_stack))
                span_start, span_key, span_stack = now, key, lines
            last_t, last_stack = now, lines

    def report(self) -> None:
        print(f"\nstall_trace: {len(self.stalls)} stalls of >= {self.min_s * 1e3:.0f} ms", file=sys.stderr)
        for at, seconds, kind, lines in sorted(self.stalls)[:80]:  # in time order
            print(f"  at {at:8.3f} s: {seconds * 1e3:8.1f} ms ({kind})", file=sys.stderr)
            for line in [*lines[:3], *(x for x in lines[3:] if any(k in x for k in OURS))][:12]:
                print(f"      {line}", file=sys.stderr)
        print(f"stall_trace: where the samples fell (ms, one sample per {self.interval_s * 1e3:g} ms)", file=sys.stderr)
        for frames, count in self.where.most_common(30):
            print(f"  {count * self.interval_s * 1e3:9.0f}  " + " <- ".join(frames), file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interval-ms", type=float, default=2.0)
    p.add_argument("--min-ms", type=float, default=50.0)
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    if not (0 < a.interval_ms < a.min_ms):
        p.error("need 0 < --interval-ms < --min-ms")
    sampler = Sampler(threading.get_ident(), a.interval_ms / 1e3, a.min_ms / 1e3)
    sampler.start()
    sys.argv = [a.script, *a.args]
    try:
        runpy.run_path(a.script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        sampler.stop.set()
        sampler.join(timeout=1.0)
        sampler.report()


if __name__ == "__main__":
    main()
