"""Probe: where a restored request's tail forward spends its GPU time, kernels by kind.

Profiles the tail forward (``--tail`` new tokens over ``--context`` cached ones) as the
engine runs it (a CUDA-graph replay, and eagerly), and prints per forward the wall time,
the kernels' summed GPU time, the gap between them, and the kernels grouped by kind.

    python bench/probes/forward_profile.py --model qwen3-8b --context 3500 --tail 22
    python bench/probes/forward_profile.py --model tiny --device cpu   # plumbing only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType  # type: ignore[attr-defined]
from torch.profiler import ProfilerActivity, profile

from hicache.backends.pools import DevicePool
from hicache.engine import ModelRunner, build_model, kv_geometry
from hicache.engine.model import PRESETS, resolve_attention

KINDS = [  # (kind, substrings of a kernel name, lower case); the first match wins
    ("attention (paged kernel)", ("_split_kernel", "_merge_kernel")),
    ("attention (SDPA)", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "gemv", "matmul", "aten::mm", "aten::addmm", "aten::bmm")),
    ("norm / rotary / activation / copies", ("",)),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return KINDS[-1][0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b" if torch.cuda.is_available() else "tiny", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=3500, help="cached tokens before the tail")
    ap.add_argument("--tail", type=int, default=22, help="new tokens of the profiled forward")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=10, help="profiled forwards per mode")
    ap.add_argument("--attention", choices=["auto", "paged", "gqa", "fold"], default="auto")
    ap.add_argument("--top", type=int, default=12, help="kernels named per mode")
    ap.add_argument("--plain-norms", action="store_true", help="keep transformers' RMSNorm (not fused)")
    ap.add_argument(
        "--plain-layers", action="store_true", help="keep transformers' attention prologue and MLP (not fused)"
    )
    ap.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    net = build_model(
        args.model,
        device=args.device,
        dtype=dtype,
        fused_norms=False if args.plain_norms else None,
        fused_layers=False if args.plain_layers else None,
    )
    ps = args.page_size
    pages = list(range(-(-(args.context + args.tail) // ps)))
    pool = DevicePool.allocate(kv_geometry(net, ps), len(pages), args.device)
    attention = resolve_attention(args.attention, args.device)
    vocab = int(net.config.vocab_size)  # type: ignore[union-attr, arg-type]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.context + args.tail,), generator=gen).tolist()
    print(
        f"{args.model} ({dtype}) on {torch.cuda.get_device_name() if cuda else 'CPU'}: "
        f"{args.tail} tokens over {args.context} cached, attention {attention}, "
        f"norms {'plain' if args.plain_norms else 'fused'}, layers {'plain' if args.plain_layers else 'fused'}"
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    result: dict[str, Any] = {"model": args.model, "context": args.context, "tail": args.tail, "modes": {}}
    for mode, graphs in (("graph replay", True), ("eager", False)):
        run = ModelRunner(net, pool, cuda_graphs=graphs, attention=attention)
        run.forward([(prompt[: args.context], pages, 0)])  # the cached prefix, computed once

        def tail(run: ModelRunner = run) -> None:
            run.forward([(prompt[args.context :], pages, args.context)])
            if cuda:
                torch.cuda.synchronize()

        for _ in range(3):  # capture (graph mode), Triton compiles, allocator warm
            tail()
        walls = []
        for _ in range(args.iterations):  # unprofiled
            t0 = time.perf_counter()
            tail()
            walls.append(time.perf_counter() - t0)
        with profile(activities=activities) as prof:
            for _ in range(args.iterations):
                tail()
        per_name: dict[str, list[float]] = defaultdict(list)
        for e in prof.events():
            if cuda and e.device_type == DeviceType.CUDA:  # a kernel: its GPU time
                per_name[e.name].append(float(e.device_time))
            elif not cuda and e.self_cpu_time_total > 0:  # CPU: ops' own time stands in
                per_name[e.name].append(float(e.self_cpu_time_total))
        n = args.iterations
        total_us = sum(sum(v) for v in per_name.values()) / n
        count = sum(len(v) for v in per_name.values()) / n
        wall_us = statistics.median(walls) * 1e6
        by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for name, times in per_name.items():
            k = by_kind[kind_of(name)]
            k[0] += sum(times) / n
            k[1] += len(times) / n
        print(f"\n{mode}: wall {wall_us / 1e3:.2f} ms per forward (median of {n}, unprofiled)")
        gap = (wall_us - total_us) / 1e3
        print(f"  kernels: {count:.0f} per forward, {total_us / 1e3:.2f} ms summed; wall minus summed {gap:.2f} ms")
        print(f"  {'kind':<40} {'ms/fwd':>8} {'share':>6} {'kernels':>8}")
        for kind, (us, c) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
            print(f"  {kind:<40} {us / 1e3:>8.3f} {us / max(total_us, 1e-9):>6.1%} {c:>8.0f}")
        heavy = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[: args.top]
        print(f"  {'heaviest kernels':<72} {'ms/fwd':>8} {'calls':>6}")
        for name, times in heavy:
            print(f"  {name[:72]:<72} {sum(times) / n / 1e3:>8.3f} {len(times) / n:>6.0f}")
        result["modes"][mode] = {
            "wall_ms": wall_us / 1e3,
            "kernel_ms": total_us / 1e3,
            "kernels": count,
            "by_kind_ms": {k: v[0] / 1e3 for k, v in by_kind.items()},
            "heaviest": [[name, sum(t) / n / 1e3, len(t) / n] for name, t in heavy],
        }
        del run
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
