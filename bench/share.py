"""Sharing KV beyond one process: the TTFT of instance B for prefixes instance A computed,
through Mooncake Store (loopback, a private network namespace) and through the ``dir`` store
after a restart, against recompute in the same process; and the store path's bytes/s
against a plain copy of the same bytes between pinned host buffers.

    python bench/share.py [--model qwen3-8b] [--prefix-tokens 3500] [--prompts 3] [--out DIR]

Each instance is a separate process: A computes the prompts (write-through to the store)
and exits; B starts cold, warms up on an unrelated prompt, then serves each prompt once
(its admission discovers the pages in the store) and once more with hicache off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import add_out_args, at_least, device_name, guarded, positive_float, write_results

from hicache.engine.cli import ArgParser

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, random, sys, time, torch
from hicache.engine import Engine, build_model
args = json.loads(sys.argv[1])
dev = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if dev == "cuda" else torch.float32
net = build_model(args["model"], device=dev, dtype=dtype, seed=0)
vocab = int(net.config.vocab_size)
rng = random.Random(5)
prompts = [[rng.randrange(vocab) for _ in range(args["prefix"])] + [1, 2, 3] for _ in range(args["prompts"])]
pages = -(-(args["prefix"] + 8) // 16) * (args["prompts"] + 2)
common = dict(device=dev, dtype=dtype, page_size=16, num_pages=max(256, pages), max_batch=4)
store = dict(enable_hicache=True, l2_pages=max(256, pages), l3_pages=4 * max(256, pages), policy="always",
             storage_backend=args["backend"], storage_path=args.get("path"), storage_extra=args.get("extra"))
e = Engine(args["model"], net=net, **common, **store)
out = {"role": args["role"]}
if args["role"] == "write":
    for p in prompts:
        e.generate(p, max_new_tokens=1)
    e.cache.drain()
    out["stored"] = e.cache.status().storage
else:
    e.generate([rng.randrange(vocab) for _ in range(args["prefix"])], max_new_tokens=1)  # warm: kernels, graphs
    rows = []
    for p in prompts:
        o = e.generate(p, max_new_tokens=1)
        rows.append({"ttft_ms": o.ttft_s * 1e3, "from": o.restored_from, "cached": o.cached_tokens})
    m = e.cache.metrics
    out["shared"] = rows
    out["discovered"] = m.l3_discovered_pages
    out["s2h_gib_s"] = m.directions["S2H"].gib_per_s
    e.close()
    plain = Engine(args["model"], net=net, **common)
    plain.generate([rng.randrange(vocab) for _ in range(args["prefix"])], max_new_tokens=1)
    out["recompute"] = [plain.generate(p, max_new_tokens=1).ttft_s * 1e3 for p in prompts]
    plain.close()
    e = None
if e is not None:
    e.close()
print("RESULT " + json.dumps(out), flush=True)
"""

BANDWIDTH = r"""
import json, os, sys, time, torch
from hicache.backends.pools import HostPool
from hicache.backends.stores import open_storage
from hicache.core.geometry import KVGeometry
args = json.loads(sys.argv[1])
g = KVGeometry(36, 8, 128, 16, torch.bfloat16) if torch.cuda.is_available() else KVGeometry(2, 2, 16, 16, torch.float32)
n = args["pages"]
host = HostPool(g, 2 * n)
host.bytes[:n].copy_(torch.randint(0, 255, (n, g.bytes_per_page), dtype=torch.uint8))
s = open_storage("mooncake", g, host, slots=4 * n, extra=args["extra"], chunk_pages=32)
keys = [os.urandom(16) for _ in range(n)]
assert s.write(list(range(n)), list(range(n)), keys).wait()
best_get = best_put = 0.0
for _ in range(3):
    t0 = time.perf_counter()
    ok = s.read(list(range(n)), list(range(n, 2 * n)), keys).wait()
    t = time.perf_counter() - t0
    assert ok and torch.equal(host.bytes[n:], host.bytes[:n])
    best_get = max(best_get, n * g.bytes_per_page / t / 2**30)
    fresh = [os.urandom(16) for _ in range(n)]
    t0 = time.perf_counter()
    ok = s.write(list(range(n)), list(range(n)), fresh).wait()
    t = time.perf_counter() - t0
    best_put = max(best_put, n * g.bytes_per_page / t / 2**30)
src, dst = host.bytes[:n], host.bytes[n:]
best_copy = 0.0
for _ in range(3):
    t0 = time.perf_counter()
    dst.copy_(src)
    t = time.perf_counter() - t0
    best_copy = max(best_copy, n * g.bytes_per_page / t / 2**30)
s.close()
print("RESULT " + json.dumps({"pages": n, "bytes": n * g.bytes_per_page, "get_gib_s": best_get,
                              "put_gib_s": best_put, "plain_copy_gib_s": best_copy}), flush=True)
"""


def _result(out: str) -> dict[str, Any]:
    line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def _plain(argv: list[str], timeout_s: float) -> str:
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO)
    if out.returncode:
        raise RuntimeError(f"{argv[-1][:60]}... failed:\n{out.stderr[-3000:]}")
    return out.stdout


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    ttft = sorted(r["ttft_ms"] for r in row["shared"])
    rec = sorted(row["recompute"])
    return {
        "ttft_ms": ttft[len(ttft) // 2],
        "recompute_ms": rec[len(rec) // 2],
        "speedup": rec[len(rec) // 2] / ttft[len(ttft) // 2],
        "sources": [r["from"] for r in row["shared"]],
        "discovered_pages": row["discovered"],
        "s2h_gib_s": row["s2h_gib_s"],
        "runs": row,
    }


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = ArgParser("python bench/share.py", __doc__)
    cuda = torch.cuda.is_available()
    ap.add_argument("--model", default="qwen3-8b" if cuda else "tiny")
    ap.add_argument("--prefix-tokens", type=at_least(1), default=3500 if cuda else 256)
    ap.add_argument("--prompts", type=at_least(1), default=3)
    ap.add_argument("--bandwidth-pages", type=at_least(1), default=219 if cuda else 64, help="pages per store batch")
    ap.add_argument("--timeout", type=positive_float, default=240.0, help="seconds per instance")
    add_out_args(ap)
    args = ap.parse_args(argv)
    base = {"model": args.model, "prefix": args.prefix_tokens, "prompts": args.prompts}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hicache-share-") as tmp:
        d = {**base, "backend": "dir", "path": str(Path(tmp) / "l3")}
        _plain([sys.executable, "-c", CHILD, json.dumps({**d, "role": "write"})], args.timeout)
        b = _result(_plain([sys.executable, "-c", CHILD, json.dumps({**d, "role": "read"})], args.timeout))
        rows.append({"store": "dir (restart)", **_summary(b)})
        sys.path.insert(0, str(REPO))
        from tests.mooncake.cluster import MooncakeCluster, Unavailable

        try:
            with MooncakeCluster.start(Path(tmp), segment_bytes=8 << 30) as mc:
                m = {**base, "backend": "mooncake", "extra": mc.extra()}
                mc.run([sys.executable, "-c", CHILD, json.dumps({**m, "role": "write"})], "a", args.timeout)
                b = _result(mc.run([sys.executable, "-c", CHILD, json.dumps({**m, "role": "read"})], "b", args.timeout))
                rows.append({"store": "mooncake (loopback)", **_summary(b)})
                bw = {"pages": args.bandwidth_pages, "extra": mc.extra()}
                got = _result(mc.run([sys.executable, "-c", BANDWIDTH, json.dumps(bw)], "bw"))
                rows.append({"store": "mooncake batch", **got})
        except Unavailable as exc:
            print(f"mooncake: skipped ({exc})")
    device = "cuda" if cuda else "cpu"
    meta = {"model": args.model, "prefix_tokens": args.prefix_tokens, "prompts": args.prompts}
    stem = write_results(args.out, f"share-{args.model}", device, meta, rows, args.tag)
    print(f"\nKV shared across processes, {args.model}, {args.prefix_tokens}-token prompts, {device_name(device)}")
    for r in rows:
        if "ttft_ms" in r:
            print(
                f"  {r['store']:<22} B's TTFT {r['ttft_ms']:8.2f} ms  recompute {r['recompute_ms']:8.2f} ms  "
                f"{r['speedup']:5.2f}x  from {r['sources']}  S2H {r['s2h_gib_s']:.1f} GiB/s"
            )
        else:
            print(
                f"  {r['store']:<22} get {r['get_gib_s']:.2f} GiB/s, put {r['put_gib_s']:.2f} GiB/s, plain host copy "
                f"{r['plain_copy_gib_s']:.2f} GiB/s ({r['get_gib_s'] / r['plain_copy_gib_s']:.2f}x), "
                f"{r['pages']} pages"
            )
    _plot(rows, stem)
    print(f"wrote {stem}.json and .png")


def _plot(rows: list[dict[str, Any]], stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft = [r for r in rows if "ttft_ms" in r]
    if not ttft:
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [r["store"] for r in ttft]
    ax.bar(names, [r["ttft_ms"] for r in ttft], color="tab:blue", label="B restores from the store")
    ax.axhline(ttft[0]["recompute_ms"], color="k", linestyle="--", label="recompute")
    for i, r in enumerate(ttft):
        ax.text(i, r["ttft_ms"], f"{r['ttft_ms']:.1f} ms ({r['speedup']:.1f}x)", ha="center", va="bottom")
    ax.set_ylabel("TTFT (ms, median)")
    ax.set_title("A prefix computed by another process: restore vs recompute")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{stem}.png", dpi=110)


if __name__ == "__main__":
    guarded(main)
