"""Probe: per attention backend, host memory kept per distinct shape, and speed.

Part 1 runs ``--shapes`` distinct shapes per case twice and prints the resident memory each
pass added (a per-shape cache grows in the first pass only, a leak in both); cases: plain
contiguous inputs and the engine's own call (K/V gathered from a page pool, a mask). Part 2
times a restored request's tail call and a decode batch's call for each ``--attention`` x
``--attention-cudnn``, as ratios to the first row. Needs CUDA.

    python bench/probes/rss_shapes.py --shapes 300
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hicache.engine.attention import paged_attention_triton
from hicache.engine.model import _folded, fold_mask, visible


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


@contextlib.contextmanager
def backends(allowed: list[SDPBackend] | None) -> Iterator[None]:
    if allowed is None:
        yield
    else:
        with sdpa_kernel(allowed):
            yield


NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=300)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tail", type=int, default=22, help="new tokens of the timed call")
    ap.add_argument("--context", type=int, default=3584, help="context tokens of the timed call")
    ap.add_argument("--decode-batch", type=int, default=32, help="sequences of the timed decode call")
    ap.add_argument("--decode-context", type=int, default=2048, help="context tokens of the timed decode call")
    ap.add_argument("--iterations", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hk, d = args.heads, args.kv_heads, args.head_dim
    slots = 8192 + 64 * args.shapes
    pool = torch.randn(2, slots, hk, d, device=dev, dtype=dt)  # one layer's K and V pages

    def engine_call(b: int, q: int, t: int, impl: str) -> Callable[[], torch.Tensor]:
        """The engine's attention over cached context: SDPA's masked call (``gqa``,
        ``fold``) or the paged Triton kernel (``paged``)."""
        query = torch.randn(b, hq, q, d, device=dev, dtype=dt)
        read = torch.randint(0, slots, (b, t), device=dev)
        ctx = torch.full((b,), t, device=dev, dtype=torch.int64) - torch.arange(b, device=dev)
        mask = visible(ctx, q, t)
        fmask = fold_mask(mask, hq // hk)  # the engine folds it once per forward, not per layer

        def call() -> torch.Tensor:
            if impl == "paged":
                return paged_attention_triton(query, pool[0], pool[1], read, ctx)
            k = pool[0][read].transpose(1, 2)
            v = pool[1][read].transpose(1, 2)
            if impl == "fold":
                return _folded(query, k, v, fmask, None)
            return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=True)

        return call

    def synthetic(i: int) -> None:
        b, q, t = 1 + i % 4, 1 + i % 24, 64 + 7 * i
        query = torch.randn(b, hq, q, d, device=dev, dtype=dt)
        k = torch.randn(b, hk, t, d, device=dev, dtype=dt)
        mask = torch.ones(b, 1, q, t, device=dev, dtype=torch.bool).tril(t - q)
        F.scaled_dot_product_attention(query, k, k, attn_mask=mask, enable_gqa=True)

    def engine_like(impl: str) -> Callable[[int], None]:
        def op(i: int) -> None:
            engine_call(1 + i % 4, 1 + i % 24, 64 + 7 * i, impl)()

        return op

    names = {b.value: n for n, b in SDPBackend.__members__.items()}
    cudnn = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    print(f"torch {torch.__version__}, cuDNN {cudnn}, {torch.cuda.get_device_name()}")
    q_probe = torch.randn(1, hq, args.tail, d, device=dev, dtype=dt)
    k_probe = torch.randn(1, hk, args.context, d, device=dev, dtype=dt)
    m_probe = torch.ones(1, 1, args.tail, args.context, device=dev, dtype=torch.bool)
    choice = torch._fused_sdp_choice(q_probe, k_probe, k_probe, m_probe, enable_gqa=True)
    print(f"default SDPA choice for the engine's masked call: {names.get(choice, choice)}")

    memory_cases: list[tuple[str, Callable[[int], None], list[SDPBackend] | None]] = [
        ("synthetic, default backends", synthetic, None),
        ("synthetic, cuDNN only", synthetic, [SDPBackend.CUDNN_ATTENTION]),
        ("engine gqa, default backends", engine_like("gqa"), None),
        ("engine gqa, cuDNN only", engine_like("gqa"), [SDPBackend.CUDNN_ATTENTION]),
        ("engine gqa, no cuDNN", engine_like("gqa"), NO_CUDNN),
        ("engine fold, no cuDNN", engine_like("fold"), NO_CUDNN),
        ("engine paged (Triton)", engine_like("paged"), NO_CUDNN),
    ]
    print(f"\n{'memory: case':<36} {'1st pass MiB':>13} {'2nd pass MiB':>13}  ({args.shapes} shapes)")
    for name, op, allowed in memory_cases:
        row = []
        try:
            with backends(allowed):
                op(10_000)  # warm the op itself
                torch.cuda.synchronize()
                for _ in range(2):
                    before = rss_mib()
                    for i in range(args.shapes):
                        op(i)
                    torch.cuda.synchronize()
                    row.append(rss_mib() - before)
        except RuntimeError as e:
            print(f"{name:<36} not available: {str(e).splitlines()[0][:60]}")
            continue
        print(f"{name:<36} {row[0]:>13.1f} {row[1]:>13.1f}")

    speed_cases: list[tuple[str, str, list[SDPBackend] | None]] = [
        ("gqa, cuDNN off", "gqa", NO_CUDNN),
        ("gqa, cuDNN on", "gqa", None),
        ("fold, cuDNN off", "fold", NO_CUDNN),
        ("fold, cuDNN on", "fold", None),
        ("paged (Triton, the default)", "paged", NO_CUDNN),
    ]
    for b, q, t in ((1, args.tail, args.context), (args.decode_batch, 1, args.decode_context)):
        label = f"speed: one layer, {b} x {q} over {t}"
        print(f"\n{label:<36} {'us/call':>9} {'speed-up':>9}")
        base = None
        for name, impl, allowed in speed_cases:
            call = engine_call(b, q, t, impl)
            with backends(allowed):
                for _ in range(5):
                    call()
                times = []
                for _ in range(args.iterations):
                    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    start.record()
                    call()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3)
            us = statistics.median(times)
            base = base or us
            print(f"{name:<36} {us:>9.1f} {base / us:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
