"""Probe: the layered restore's stream pattern without the engine; does it stall or corrupt?

Each round: the layered H2D (``TransferEngine.h2d`` with layer events) on the transfer
stream, a captured "layered forward" graph on a side stream whose layer ``l`` waits on its
layer's event, and "decode" graph replays (and captures) on the caller's stream meanwhile.
Every GPU wait polls with a deadline; a stall names the pending stream or event and exits
with status 3. ``--gemms qwen3-8b`` uses split-K GEMMs (cuBLAS workspace) and checks every
replay's output; ``--capture shared`` captures both graphs on torch's one default capture
stream (one shared cuBLAS workspace), ``separate`` on their own streams. Needs CUDA.

    python bench/probes/layered_hang_min.py [--rounds 200] [--gemms square|qwen3-8b] [--capture shared|separate]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.transfer import TransferEngine
from hicache.core.geometry import KVGeometry


def poll(what: str, done: Any, deadline: float, state: Any) -> None:
    t0 = time.perf_counter()
    while not done.query():
        if time.perf_counter() - t0 > deadline:
            print(f"\nSTALL waiting for {what} ({deadline:.0f} s)\n{state()}", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(1e-4)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--pages", type=int, default=219, help="pages per restore (219: a 3,500-token prefix)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--decodes", type=int, default=3, help="decode replays per round")
    ap.add_argument("--capture-every", type=int, default=5, help="capture a new decode graph every N rounds")
    ap.add_argument("--no-capture", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=10.0)
    ap.add_argument("--gemms", choices=("square", "qwen3-8b"), default="square")
    ap.add_argument("--capture", choices=("shared", "separate"), default="shared")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    g = KVGeometry(36, 8, 128, 16, torch.bfloat16)
    n, h = args.pages, args.hidden
    l1 = DevicePool.allocate(g, 2 * n + 8, "cuda")
    l2 = HostPool(g, 2 * n + 8)
    l2.page_buffer.copy_(torch.randn(l2.page_buffer.shape).to(g.dtype))
    transfer = TransferEngine(l1, l2, "auto")
    if not transfer.layered:
        raise SystemExit("the layered H2D needs cuda-python here")
    groups = transfer.layer_groups()
    shared = [torch.cuda.Event(external=True) for _ in groups]  # type: ignore[no-untyped-call]
    events = [e for e, (lo, hi) in zip(shared, groups, strict=True) for _ in range(lo, hi)]
    for e in shared:
        e.record()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    w = torch.randn(h, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    x = torch.randn(64, h, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(h, 3 * h, device="cuda", dtype=torch.bfloat16) / h**0.5
    down = torch.randn(3 * h, h, device="cuda", dtype=torch.bfloat16) / (3 * h) ** 0.5
    qwen = args.gemms == "qwen3-8b"

    def mlp(y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.nn.functional.silu(y @ up) @ down
        return out

    dst = list(range(1, 2 * n, 2))  # scattered L1 pages, as the allocator leaves them
    ids = torch.tensor(dst, device="cuda")

    def layered_body() -> torch.Tensor:
        y = x
        for layer in range(g.num_layers):
            events[layer].wait(torch.cuda.current_stream())
            kv = l1.slabs[layer].index_select(0, ids[:8]).float().mean()
            y = (mlp(y) if qwen else y @ w) * (1 + kv.to(y.dtype) * 0)  # reads this layer's landed pages
        return y

    decode_capture = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def capture(body: Any, stream: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        on = None if args.capture == "shared" else (side if stream is side else decode_capture)
        with torch.cuda.stream(on or stream):
            body()  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=on):
            out = body()
        graph.replay()
        torch.cuda.synchronize()
        return graph, out, out.clone()  # the output of a replay with nothing beside it

    transfer.h2d(list(range(n)), dst, layer_events=events).wait()  # first: allocations, autotune
    if qwen:
        x = x[:6]
    layered_graph, layered_out, layered_ref = capture(layered_body, side)
    decode_graphs = [capture((lambda: mlp(x[:4])) if qwen else (lambda: (x @ w) @ w), torch.cuda.current_stream())]
    wrong = 0
    main_stream = torch.cuda.current_stream()

    def state() -> str:
        def q(e: Any) -> str:
            return "done" if e.query() else "PENDING"

        return "\n".join(
            [
                f"caller stream {q(main_stream)}; side stream {q(side)}, done event {q(done)}",
                "group events " + " ".join(q(e) for e in shared),
                f"transfer stream {q(transfer.stream)}",
            ]
        )

    t0 = time.perf_counter()
    for r in range(args.rounds):
        src = list(range(n)) if r % 2 == 0 else list(range(n + 8, 2 * n + 8))
        ticket = transfer.h2d(src, dst, layer_events=events)
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            layered_graph.replay()
            done.record()
        for i in range(args.decodes):
            if not args.no_capture and i == 0 and r % args.capture_every == args.capture_every - 1:
                if qwen:
                    rows = 1 + len(decode_graphs) % 5  # a new shape: a new graph, captured now
                    decode_graphs.append(capture(lambda rows=rows: mlp(x[:rows]), main_stream))
                else:
                    rows = 8 + len(decode_graphs) % 56
                    decode_graphs.append(capture(lambda rows=rows: (x[:rows] @ w) @ w, main_stream))
            graph, out, ref = decode_graphs[(r + i) % len(decode_graphs)]
            graph.replay()
            poll(f"decode replay {i} of round {r}", main_stream, args.deadline_s, state)
            wrong += not torch.equal(out, ref)
        poll(f"the H2D of round {r}", ticket.event, args.deadline_s, state)
        assert ticket.wait()
        main_stream.wait_stream(side)  # the join
        poll(f"the join of round {r}", main_stream, args.deadline_s, state)
        wrong += not torch.equal(layered_out, layered_ref)
        if r % 50 == 49:
            print(f"round {r + 1}: {time.perf_counter() - t0:.1f} s, {wrong} outputs differ so far", flush=True)
    print(
        f"no stall in {args.rounds} rounds ({len(decode_graphs)} decode graphs, {args.gemms} GEMMs, "
        f"{args.capture} capture), {time.perf_counter() - t0:.1f} s; {wrong} outputs differ from their replay alone"
    )


if __name__ == "__main__":
    main()
