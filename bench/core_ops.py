"""CPU cost of the core's bookkeeping: match / insert / evict / check_integrity.

Builds trees of growing size (prompts of 4,096 tokens, each branching off a random earlier
prompt at a random page) at page sizes 1 and 16, and prints µs per operation and how it
grows with the tree. Writes JSON + PNG under ``--out``.

    python bench/core_ops.py [--nodes 1000 3000 10000] [--page-sizes 1 16]
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time

from common import add_out_args, at_least, guarded, write_results
from tqdm import tqdm

from hicache.core import CacheCore, TierSizes
from hicache.engine.cli import ArgParser
from hicache.spec.model import Tier

PROMPT = 4096


def build(page_size: int, nodes: int, rng: random.Random) -> tuple[CacheCore, list[tuple[int, ...]]]:
    """A tree of about ``nodes`` nodes: each new prompt shares a random page-aligned prefix
    (at least half, so memory stays modest at page size 1) with a random earlier one."""
    pages_per_prompt = PROMPT // page_size
    budget = nodes // 2 * pages_per_prompt + pages_per_prompt
    core = CacheCore(page_size, TierSizes(l1_pages=budget, l2_pages=0, l3_pages=0))
    prompts: list[tuple[int, ...]] = []
    with tqdm(total=nodes, desc=f"build ps={page_size}", unit="node", leave=False, disable=None) as bar:
        while len(core.tree.nodes) - 1 < nodes:
            if prompts:
                base = rng.choice(prompts)
                share = rng.randrange(pages_per_prompt // 2, pages_per_prompt) * page_size
                prompt = base[:share] + tuple(rng.randrange(256) for _ in range(PROMPT - share))
            else:
                prompt = tuple(rng.randrange(256) for _ in range(PROMPT))
            before = len(core.tree.nodes)
            _insert(core, prompt)
            prompts.append(prompt)
            bar.update(len(core.tree.nodes) - before)
    return core, prompts


def _insert(core: CacheCore, prompt: tuple[int, ...]) -> float:
    """Insert like an engine would; returns the seconds spent in match + insert."""
    t0 = time.perf_counter()
    hit = core.match(prompt)
    shared = core.pages_l1(hit.l1)
    t1 = time.perf_counter()
    pages = core.allocate_l1(len(prompt) // core.page_size - len(shared))
    assert pages is not None
    t2 = time.perf_counter()
    result = core.insert(prompt, shared + pages)
    t3 = time.perf_counter()
    core.free_private(result.rejected)
    return (t1 - t0) + (t3 - t2)


def measure(page_size: int, nodes: int, seed: int = 0, reps: int = 200) -> dict[str, float]:
    rng = random.Random(seed)
    core, prompts = build(page_size, nodes, rng)
    match_us = []
    for _ in range(reps):
        prompt = rng.choice(prompts)
        t0 = time.perf_counter()
        core.match(prompt)
        match_us.append((time.perf_counter() - t0) * 1e6)
    insert_us = []
    for _ in range(reps // 4):  # each grows the tree by ~2 nodes
        base = rng.choice(prompts)
        share = rng.randrange(PROMPT // page_size // 2, PROMPT // page_size) * page_size
        prompt = base[:share] + tuple(rng.randrange(256) for _ in range(PROMPT - share))
        insert_us.append(_insert(core, prompt) * 1e6)
    integrity_ms = []
    for _ in range(3):
        t0 = time.perf_counter()
        core.check_integrity()
        integrity_ms.append((time.perf_counter() - t0) * 1e3)
    evict_us = []
    for _ in range(reps):
        t0 = time.perf_counter()
        core.evict(Tier.L1, 1)
        evict_us.append((time.perf_counter() - t0) * 1e6)
    return {
        "page_size": page_size,
        "nodes": len(core.tree.nodes) - 1,
        "match_us": statistics.median(match_us),
        "insert_us": statistics.median(insert_us),
        "evict_us": statistics.median(evict_us),
        "check_integrity_ms": statistics.median(integrity_ms),
    }


def main() -> None:
    ap = ArgParser("python bench/core_ops.py", __doc__)
    ap.add_argument("--nodes", type=at_least(1), nargs="+", default=[1000, 3000, 10000], help="tree sizes")
    ap.add_argument("--page-sizes", type=at_least(1), nargs="+", default=[1, 16], help="tokens per page")
    add_out_args(ap)
    args = ap.parse_args()
    rows = [measure(ps, n) for ps in args.page_sizes for n in args.nodes]
    print(f"\ncore bookkeeping, {PROMPT}-token prompts, median µs per operation ({platform.processor() or 'cpu'})")
    print(f"{'page':>4} {'nodes':>7} {'match':>9} {'insert':>9} {'evict':>8} {'integrity ms':>13}")
    for r in rows:
        print(
            f"{r['page_size']:>4} {r['nodes']:>7} {r['match_us']:>9.1f} {r['insert_us']:>9.1f} "
            f"{r['evict_us']:>8.1f} {r['check_integrity_ms']:>13.1f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "processor": platform.processor() or None}
    stem = write_results(args.out, "core_ops", "cpu", meta, rows, args.tag)
    meta = json.loads(stem.with_suffix(".json").read_text())["meta"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.5))
    for ax, key in zip(axes, ["match_us", "insert_us", "evict_us", "check_integrity_ms"], strict=True):
        for ps in args.page_sizes:
            pts = [(r["nodes"], r[key]) for r in rows if r["page_size"] == ps]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"page size {ps}")
        ax.set_xscale("log")
        ax.set_xlabel("tree nodes (log scale)")
        ax.set_title({"check_integrity_ms": "check_integrity (ms)"}.get(key, key.replace("_us", " (µs)")))
        ax.legend()
    fig.suptitle(f"hicache core bookkeeping ({PROMPT}-token prompts), {meta['date']}, CPU")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=100)
    print(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    guarded(main)
