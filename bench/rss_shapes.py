"""Host memory kept per distinct tensor shape: which CUDA op caches grow with shape variety.

The GPU soak's resident memory grows in glibc's heap (live ``malloc`` blocks, not Python
objects nor CPU tensors) and faster when decode runs eagerly, which points at per-shape
caches in the libraries the engine calls. For each op the engine's forward uses (attention
through ``scaled_dot_product_attention`` with each backend forced, and the default choice;
a bf16 matmul), this runs ``--shapes`` distinct shapes, then the same shapes again, and
prints the resident memory each pass added: a cache grows in the first pass only, a leak
in both.

    python bench/rss_shapes.py --shapes 300
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=300)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2560)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hk, d = args.heads, args.kv_heads, args.head_dim

    def masked(i: int) -> None:  # a batch with cached context: q new tokens over T keys
        b, q, t = 1 + i % 4, 1 + i % 24, 64 + 7 * i
        query = torch.randn(b, hq, q, d, device=dev, dtype=dt)
        k = torch.randn(b, hk, t, d, device=dev, dtype=dt)
        mask = torch.ones(b, 1, q, t, device=dev, dtype=torch.bool).tril(t - q)
        F.scaled_dot_product_attention(query, k, k, attn_mask=mask, enable_gqa=True)

    def causal(i: int) -> None:  # a fresh prefill
        q = 16 + 7 * i
        query = torch.randn(1, hq, q, d, device=dev, dtype=dt)
        k = torch.randn(1, hk, q, d, device=dev, dtype=dt)
        F.scaled_dot_product_attention(query, k, k, is_causal=True, enable_gqa=True)

    w = torch.randn(args.hidden, 4 * args.hidden, device=dev, dtype=dt)

    def matmul(i: int) -> None:
        torch.randn(1 + 3 * i, args.hidden, device=dev, dtype=dt) @ w

    probe_q = torch.randn(2, hq, 5, d, device=dev, dtype=dt)
    probe_k = torch.randn(2, hq, 300, d, device=dev, dtype=dt)
    probe_m = torch.ones(2, 1, 5, 300, device=dev, dtype=torch.bool)
    chosen = {
        "masked": torch._fused_sdp_choice(probe_q, probe_k, probe_k, probe_m),
        "causal": torch._fused_sdp_choice(probe_q, probe_k, probe_k, None, 0.0, True),
    }
    names = {b.value: n for n, b in SDPBackend.__members__.items()}
    cudnn = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    print(f"torch {torch.__version__}, cuDNN {cudnn}, {torch.cuda.get_device_name()}")
    print("default SDPA backend: " + ", ".join(f"{k} -> {names.get(v, v)}" for k, v in chosen.items()))

    def forced(backend: SDPBackend | None) -> Callable[[], contextlib.AbstractContextManager[None]]:
        @contextlib.contextmanager
        def ctx() -> Iterator[None]:
            if backend is None:
                yield
            else:
                with sdpa_kernel([backend]):
                    yield

        return ctx

    cases: list[tuple[str, Callable[[int], None], Callable[[], contextlib.AbstractContextManager[None]]]] = [
        ("matmul bf16", matmul, forced(None)),
        ("sdpa causal default", causal, forced(None)),
        ("sdpa masked default", masked, forced(None)),
    ]
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        cases.append((f"sdpa causal {backend.name}", causal, forced(backend)))
        cases.append((f"sdpa masked {backend.name}", masked, forced(backend)))
    print(f"{'case':<36} {'1st pass MiB':>13} {'2nd pass MiB':>13}  ({args.shapes} shapes)")
    for name, op, ctx in cases:
        row = []
        try:
            with ctx():
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
