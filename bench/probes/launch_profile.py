"""Probe: where the host time of starting a layered restore goes.

Runs the stress bench's overlap variant (``--no-rotation``) with each step of
``Engine._admit`` for a restore timed (warm-up included: the longest call shows a one-time
graph capture). Extra flags go to the stress bench; with ``--latency`` first, to the latency
bench (``bench_hicache.py``) instead. Needs CUDA.

    python bench/probes/launch_profile.py --model qwen3-8b
    python bench/probes/launch_profile.py --latency --model qwen3-8b --prefix-tokens 3500 --tiers l2
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the stress bench
import bench_hicache
import bench_hicache_stress
from common import with_defaults

from hicache.backends.transfer import TransferEngine
from hicache.core.controller import Controller
from hicache.engine.engine import Engine
from hicache.engine.model import ModelRunner, _Graph

seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()
longest: collections.defaultdict[str, float] = collections.defaultdict(float)
inside: list[str] = []  # the outer step being timed: "start" or "launch"


def timed(owner: Any, name: str, key: str, *, outer: bool = False, layered_only: bool = False) -> None:
    """Wrap ``owner.name`` so its time counts under ``key`` (inside a restore's start only,
    unless ``outer``: then it marks that start; ``layered_only``: layered starts only)."""
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if (not outer and not inside) or (layered_only and kwargs.get("layer_events") is None):
            return fn(*args, **kwargs)
        if outer:
            inside.append(key)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            k, dt = key if outer else f"{inside[-1]}: {key}", time.perf_counter() - t0
            seconds[k] += dt
            calls[k] += 1
            longest[k] = max(longest[k], dt)
            if outer:
                inside.pop()

    setattr(owner, name, wrapper)


def main(argv: list[str]) -> None:
    timed(Controller, "start_restore", "start", outer=True, layered_only=True)
    timed(Engine, "_launch_layered", "launch", outer=True)
    timed(TransferEngine, "flush", "flush", outer=True)
    timed(TransferEngine, "h2d", "TransferEngine.h2d")
    timed(Controller, "allocate", "Controller.allocate")
    timed(ModelRunner, "forward", "ModelRunner.forward")
    timed(ModelRunner, "_upload", "ModelRunner._upload")
    timed(ModelRunner, "_graph", "ModelRunner._graph")
    timed(ModelRunner, "slots", "ModelRunner.slots")
    timed(_Graph, "run", "_Graph.run")
    timed(_Graph, "_capture", "_Graph._capture")  # how many first-use captures the launches held
    timed(torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay")
    timed(torch.Tensor, "clone", "Tensor.clone")
    if argv[:1] == ["--latency"]:
        bench_hicache.main(argv[1:])
    else:
        bench_hicache_stress.main(with_defaults(["--no-rotation", "--repeats", "1", "--decoders", "4"], argv))
    launches = calls["launch"] or 1
    print(f"\nHost time per restore start ({calls['start']} starts, {calls['launch']} layered launches):")
    for key in sorted(seconds, key=lambda k: (k.split(":")[0], -seconds[k])):
        per = calls["start"] if key.startswith("start") else calls["flush"] if key.startswith("flush") else launches
        print(
            f"  {key:<40} {seconds[key] / per * 1e3:7.3f} ms  ({calls[key]} calls, "
            f"the longest {longest[key] * 1e3:.1f} ms)"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
