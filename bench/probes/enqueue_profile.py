"""Where the host time of one transfer goes: cProfile over repeated transfers of N pages
(default 64; the default engine, Qwen3-8B pages), per L2 layout and direction, after the
tickets' median enqueue / service / total without the profiler. A probe, run by hand on a
GPU machine: ``python bench/probes/enqueue_profile.py [N]`` (with ``bench/`` on the path)."""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys

import torch
from transfer import QWEN3_8B, Setup

from hicache.backends.ticket import Ticket
from hicache.backends.transfer import TransferEngine

REPS = 60


def one(e: TransferEngine, d2h: bool, l1: list[int], l2: list[int]) -> Ticket:
    return e.d2h(l1, l2) if d2h else e.h2d(l2, l1)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    s = Setup(QWEN3_8B, n, "cuda", "auto")
    e = s.engines["default"]
    for layout, l2 in (("consecutive", list(range(n))), ("fragmented", list(range(0, 2 * n, 2)))):
        for d2h in (True, False):
            l1 = list(range(0 if d2h else 1, 2 * n, 2))
            tickets = []
            for i in range(REPS + 5):
                t = one(e, d2h, l1, l2)
                assert t.wait(), t.error
                if i >= 5:
                    tickets.append(t)
            med = {
                part: round(statistics.median(getattr(t.timings, f"{part}_s") for t in tickets) * 1e3, 3)
                for part in ("enqueue", "service", "total")
            }
            print(f"== {n} pages {layout} {'d2h' if d2h else 'h2d'}: paths {dict(e.paths)} median ms {med}")
            e.paths.update(dict.fromkeys(e.paths, 0))
            profile = cProfile.Profile()
            torch.cuda.synchronize()
            for _ in range(REPS):
                profile.enable()
                t = one(e, d2h, l1, l2)
                profile.disable()
                t.wait()
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(18)
            print("\n".join(out.getvalue().splitlines()[4:32]))


if __name__ == "__main__":
    main()
