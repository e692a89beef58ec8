"""Can a restore be loaded layer by layer fast enough? H2D ways compared in one run.

8x at 3,500 tokens needs the restore's H2D (~10 ms) overlapped with the tail's forward
(~12 ms): attention of layer l waiting only for layer l. L2 is page-major, so a layer's
data is 2n strided pieces of n pages. ``kernels.load_layers_triton`` reads them in place
from pinned host memory (zero-copy, over PCIe, by the GPU's SMs). This measures, for the
Qwen3-8B geometry and ``--pages`` pages, GiB/s and the ratio to a plain pinned copy of the
same bytes (the DMA engine) for:

* ``pinned copy``: one ``copy_`` of the bytes (the reference);
* ``DMA + scatter``: what the transfer engine does today (one DMA of the run, one scatter);
* ``zero-copy, all layers``: one ``load_layers_triton`` launch;
* ``zero-copy, per layer``: one launch per layer, as a layer-pipelined restore would issue;

then checks every loaded page is bit-identical to its L2 page, and measures how much a
per-layer zero-copy load on a side stream slows a matmul loop on the main stream (the SMs it
takes from the forward it would overlap). Needs CUDA.

    python bench/layer_load.py --pages 219 1024
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transfer import QWEN3_8B, gpu

from hicache.backends import kernels
from hicache.backends.pools import DevicePool, HostPool


def dma_scatter(host: torch.Tensor, packed: torch.Tensor, dst_ids: torch.Tensor, l1_slabs: torch.Tensor) -> None:
    """What the transfer engine does for one run of L2 pages: one DMA, one scatter."""
    packed.copy_(host, non_blocking=True)
    kernels.scatter_triton(packed, dst_ids, l1_slabs)


def zero_copy(
    l2_slabs: torch.Tensor,
    src_ids: torch.Tensor,
    l1_slabs: torch.Tensor,
    dst_ids: torch.Tensor,
    ranges: list[tuple[int, int]],
) -> None:
    """One zero-copy launch per layer range."""
    for r in ranges:
        kernels.load_layers_triton(l2_slabs, src_ids, l1_slabs, dst_ids, r)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, nargs="+", default=[219, 1024], help="219 pages = 3,500 tokens")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    g = QWEN3_8B
    most = max(args.pages)
    l2 = HostPool(g, 2 * most)
    l2.slabs.view(torch.int16).random_(-(2**15), 2**15 - 1)
    l1 = DevicePool.allocate(g, 2 * most, "cuda")
    layers = g.num_layers
    rows: list[dict[str, Any]] = []
    print(f"Qwen3-8B KV, {torch.cuda.get_device_name()}, {date.today()}; {g.bytes_per_page / 2**20:.2f} MiB per page")
    print(f"{'pages':>6} {'way':<24} {'ms':>8} {'GiB/s':>8} {'vs pinned copy':>15}")
    for n in args.pages:
        nbytes = n * g.bytes_per_page
        src_ids = torch.arange(most - n // 2, most - n // 2 + n, device="cuda")  # one L2 run
        dst_ids = torch.randperm(2 * most, device="cuda")[:n]  # scattered L1 pages
        host = l2.slabs[most - n // 2 : most - n // 2 + n]
        packed = torch.empty(host.shape, dtype=host.dtype, device="cuda")

        all_layers, each_layer = [(0, layers)], [(x, x + 1) for x in range(layers)]
        base = None
        for way, fn in (
            ("pinned copy", partial(packed.copy_, host, non_blocking=True)),
            ("DMA + scatter", partial(dma_scatter, host, packed, dst_ids, l1.slabs)),
            ("zero-copy, all layers", partial(zero_copy, l2.slabs, src_ids, l1.slabs, dst_ids, all_layers)),
            ("zero-copy, per layer", partial(zero_copy, l2.slabs, src_ids, l1.slabs, dst_ids, each_layer)),
        ):
            l1.slabs.zero_()
            s = gpu(fn, args.reps)
            base = base or s
            if way != "pinned copy":  # every loaded page bit-identical to its L2 page
                got = l1.slabs.index_select(1, dst_ids).transpose(0, 1).cpu()
                ok = torch.equal(got.view(torch.int16), host.view(torch.int16))
            else:
                ok = torch.equal(packed.cpu().view(torch.int16), host.view(torch.int16))
            row = {"pages": n, "way": way, "ms": s * 1e3, "gib_per_s": nbytes / s / 2**30, "vs_pinned": base / s}
            row["bit_identical"] = ok
            rows.append(row)
            flag = "" if ok else "  PAGES DIFFER"
            print(f"{n:>6} {way:<24} {s * 1e3:>8.3f} {nbytes / s / 2**30:>8.1f} {base / s:>14.2f}x{flag}")
    # interference: a matmul loop alone, then with per-layer zero-copy loads on a side stream
    n = args.pages[0]
    src_ids = torch.arange(n, device="cuda")
    dst_ids = torch.arange(n, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def compute() -> None:
        for _ in range(40):
            a @ a

    load_each = partial(zero_copy, l2.slabs, src_ids, l1.slabs, dst_ids, [(x, x + 1) for x in range(layers)])

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            load_each()
        compute()
        torch.cuda.current_stream().wait_stream(side)

    alone, together, load = gpu(compute, args.reps), gpu(both, args.reps), gpu(load_each, args.reps)
    print(
        f"\noverlap ({n} pages, per-layer zero-copy on a side stream): matmul loop {alone * 1e3:.2f} ms alone, "
        f"load {load * 1e3:.2f} ms alone, both {together * 1e3:.2f} ms "
        f"({(alone + load - together) / min(alone, load):.0%} of the shorter hidden)"
    )
    result = {
        "date": str(date.today()),
        "device": torch.cuda.get_device_name(),
        "rows": rows,
        "overlap": {"pages": n, "compute_ms": alone * 1e3, "load_ms": load * 1e3, "both_ms": together * 1e3},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"layer_load-{date.today()}-h200.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
