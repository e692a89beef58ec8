"""Probe: where a 3,500-token layered H2D's service goes over a plain pinned copy of its bytes.

Qwen3-8B KV geometry on CUDA, 218 pages (3,488 tokens), L1 pages consecutive (the engine's
row DMAs out of the ring) unless ``--fragmented-l1``. Each figure is the ratio of a plain
pinned copy of the same bytes (measured alone in the same run) to the engine's layered H2D
service (its ticket's CUDA events), median of ``--reps`` after one discarded, alone and
beside a stand-in forward (a loop of small matmuls that reads its weights from HBM, as a
restored tail's forward does), for:

* the engine as configured (ring of 4 slots of 64 MiB: the 11 layer groups refill slots);
* a ring of 8 slots (no slot refilled: whether waiting for a slot's row DMAs costs rate);
* the same restore's events waited on by a kernel stream (as the forward waits for them).

Also the 64 MiB-per-slot ring's per-group DMA count (host enqueue, ms). Prints one line per
case and the pages' bit-identity to L2 after each.

    python bench/probes/layered_service.py [--pages 218] [--reps 10]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the transfer bench's geometry
from transfer import QWEN3_8B, device_span, probe_parser, random_pools

from hicache.backends import dma
from hicache.backends.transfer import TransferEngine


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__, reps=10)
    ap.set_defaults(pages=218)
    ap.add_argument("--fragmented-l1", action="store_true", help="L1 pages every other page (the scatter kernel)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not dma.AVAILABLE:
        print("needs CUDA and cuda-python", file=sys.stderr)
        return 2
    g, n, reps = QWEN3_8B, args.pages, args.reps
    l1, l2 = random_pools(g, 2 * n + 8)
    nbytes = n * g.bytes_per_page
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = dma.new_stream(torch.device("cuda"))
    plain = device_span(lambda: dma.copy_raw(dev.data_ptr(), host.data_ptr(), nbytes, stream), [stream], reps)
    x = torch.randn(22, 4096, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(4096, 12288, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

    def compute() -> None:
        for i in range(300):
            x @ weights[i % 4]

    print(f"{torch.cuda.get_device_name()}, {n} pages ({nbytes / 2**20:.0f} MiB): plain H2D {plain:.3f} ms alone")
    l2_pages = list(range(n))
    l1_pages = list(range(1, 2 * n, 2)) if args.fragmented_l1 else list(range(4, 4 + n))
    waiter = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    for label, kw, wait in (
        ("default ring (4 x 64 MiB)", {}, False),
        ("ring of 8 x 64 MiB", {"chunks": 8}, False),
        ("default ring, events waited on", {}, True),
    ):
        engine = TransferEngine(l1, l2, "auto", **kw)  # type: ignore[arg-type]
        for beside in (False, True):
            svc: list[float] = []
            enq: list[float] = []
            for _ in range(reps + 1):
                torch.cuda.synchronize()
                l1.slabs.zero_()
                events = [torch.cuda.Event() for _ in range(g.num_layers)]  # type: ignore[no-untyped-call]
                if beside:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        compute()
                t0 = time.perf_counter()
                ticket = engine.h2d(l2_pages, l1_pages, events)
                enq.append((time.perf_counter() - t0) * 1e3)
                if wait:
                    with torch.cuda.stream(waiter):
                        for e in events:
                            waiter.wait_event(e)
                            torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]
                if not ticket.wait():
                    raise RuntimeError(f"{label}: layered H2D failed")
                svc.append(ticket.timings.service_s * 1e3)
                torch.cuda.synchronize()
            status = engine.status()
            got = l1.slabs[:, l1_pages].transpose(0, 1).cpu().view(torch.int16)
            ok = torch.equal(got, l2.slabs[l2_pages].view(torch.int16))
            s = statistics.median(svc[1:])
            print(
                f"  {label:<34} {'beside' if beside else 'alone '}: service {s:.3f} ms, {plain / s:.3f} of plain; "
                f"enqueue {statistics.median(enq[1:]):.3f} ms; d2d {status['d2d']}, pages bit-identical {ok}"
            )
        del engine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
