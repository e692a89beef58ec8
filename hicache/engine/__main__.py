"""Serve a synthetic workload with the reference engine and print what happened.

    python -m hicache.engine --enable-hicache --requests 200 --prefixes 8 --prefix-tokens 350

Requests draw one of ``--prefixes`` shared prefixes (in rotation) plus a random suffix;
``--concurrency`` of them are in flight at once. Prints throughput, TTFT, where cached
tokens came from, and the cache's metrics.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tqdm import tqdm

from hicache.engine.cli import add_engine_args, engine_from_args
from hicache.engine.engine import Output


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    w = ap.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=100)
    w.add_argument("--prefixes", type=int, default=8)
    w.add_argument("--prefix-tokens", type=int, default=350)
    w.add_argument("--suffix-tokens", type=int, default=8)
    w.add_argument("--max-new-tokens", type=int, default=4)
    w.add_argument("--concurrency", type=int, default=4)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--json", action="store_true", help="print the full status as JSON at the end")
    args = ap.parse_args(argv)
    engine = engine_from_args(args)
    rng = random.Random(args.seed)
    vocab = int(engine.net.config.vocab_size)  # type: ignore[union-attr, arg-type]
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    outs: list[Output] = []
    t0 = time.perf_counter()
    with tqdm(total=args.requests, desc="requests") as bar:
        submitted = 0
        while len(outs) < args.requests:
            while submitted < args.requests and engine.pending < args.concurrency:
                suffix = [rng.randrange(vocab) for _ in range(args.suffix_tokens)]
                engine.submit(prefixes[submitted % args.prefixes] + suffix, args.max_new_tokens)
                submitted += 1
            done = engine.step()
            outs.extend(done)
            bar.update(len(done))
    wall = time.perf_counter() - t0
    engine.cache.drain()
    engine.cache.check_integrity()
    st = engine.status()
    m = engine.cache.metrics
    ttft = sorted(o.ttft_s for o in outs if o.error is None)
    print(f"\n{args.requests} requests in {wall:.2f} s: {args.requests / wall:.2f} req/s")
    print(f"TTFT ms: median {statistics.median(ttft) * 1e3:.2f}, p90 {ttft[int(0.9 * (len(ttft) - 1))] * 1e3:.2f}")
    print("served from:", {s: sum(o.restored_from == s for o in outs) for s in ("L1", "L2", "L3")})
    print("hit tokens:", dict(m.hit_tokens), "recomputed:", m.recomputed_tokens, "fallbacks:", m.fallbacks)
    print("engine:", {k: round(v, 4) if isinstance(v, float) else v for k, v in engine.stats.__dict__.items()})
    if args.json:
        print(json.dumps(st, indent=1, default=str))
    engine.close()


if __name__ == "__main__":
    main()
