"""Probe: a ring D2H with its first pages by the copy path (``ring_head_pages``), A/B.

Qwen3-8B page geometry (2.25 MiB pages), L1 pages every other page of the pool as in
``bench/transfer.py``. For each size and L2 layout (consecutive, every other page), engines
with ``ring_head_pages`` 0 (the ring alone), 4, 8 and 16 take turns, sample by sample, so a
drifting host speed falls on all of them alike; each figure is the median wall time of a
D2H (call to completed ticket) as a ratio to a plain pinned copy of the same bytes measured
in the same loop. Also checks the pages each engine wrote (bit-exact against L1).

    python bench/probes/ring_head.py [--pages 64 256] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the transfer bench's geometry
from transfer import QWEN3_8B, random_pools

from hicache.backends.transfer import TransferEngine

HEADS = (0, 4, 8, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    top = 2 * max(args.pages) + 2
    l1, l2 = random_pools(QWEN3_8B, top)
    l1.buffer.view(torch.int16).random_(-(2**15), 2**15 - 1)
    engines = {h: TransferEngine(l1, l2, "auto", ring_head_pages=h) for h in HEADS}
    for e in engines.values():
        e.prepare()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ratio to a plain pinned copy (wall)")
    for n in args.pages:
        nbytes = n * QWEN3_8B.bytes_per_page
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        src = list(range(0, 2 * n, 2))
        for layout, l2_pages in (("consecutive", list(range(n))), ("fragmented", list(range(1, 2 * n, 2)))):
            times: dict[object, list[float]] = {h: [] for h in HEADS}
            times["plain"] = []
            for i in range(args.reps + 1):
                for key in ["plain", *HEADS]:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if key == "plain":
                        host.copy_(dev, non_blocking=True)
                        torch.cuda.synchronize()
                    else:
                        ticket = engines[key].d2h(src, l2_pages)  # type: ignore[index]
                        if not ticket.wait():
                            raise RuntimeError(f"d2h failed: {ticket.error}")
                    if i:
                        times[key].append(time.perf_counter() - t0)
            plain = statistics.median(times["plain"])
            want = l1.slabs[:, src].transpose(0, 1).cpu().view(torch.int16)
            exact = True
            for e in engines.values():  # each engine's own pages, from zeroed L2 pages
                l2.slabs[l2_pages] = 0
                exact &= e.d2h(src, l2_pages).wait() and torch.equal(l2.slabs[l2_pages].view(torch.int16), want)
            cells = "  ".join(f"head {h}: {plain / statistics.median(times[h]):.3f}" for h in HEADS)
            print(f"{n:5d} pages {layout:<12} plain {plain * 1e3:.3f} ms  {cells}  pages exact: {exact}")


if __name__ == "__main__":
    main()
