"""Latency by tier: TTFT of a request whose prefix must come from recompute, L2 or L3.

Two different prefixes alternate so each evicts the other from L1 (and, for the L3 case,
from L2): L1 holds one prefix, L2 one (tier l3) or both (tier l2), L3 both. Policy
``always`` forces the tier; tier ``none`` is the engine without hicache (recompute). Per
prefix length: median TTFT over the iterations after warm-up alternations, speed-up over
recompute, the per-direction bandwidths from the metrics, and whether greedy outputs match
recompute. Writes JSON + PNG under ``--out`` (default $HICACHE_BENCH_OUT or
/tmp/hicache-bench). TTFT and bandwidth depend on timing; page fingerprints and greedy
outputs do not.

    python bench/bench_hicache.py --model qwen3-8b --prefix-tokens 350 1000 2000 3500
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

try:  # NOTE: these import torch (seconds): Ctrl-C there ends as it does later, one line and 130
    import torch
    from common import (
        CallTimer,
        PageCheck,
        add_out_args,
        at_least,
        device_name,
        engine_settings,
        guarded,
        results_done,
        write_results,
    )
    from plots import plot_latency
    from tqdm import tqdm

    import hicache.backends.transfer as transfer_engine
    import hicache.engine.engine as engine_module
    import hicache.engine.model as model_runner
    from hicache.engine import build_model
    from hicache.engine.cli import (
        ArgParser,
        add_engine_args,
        check_flags,
        dtype_of,
        engine_from_args,
        served_from,
        warn,
    )
    from hicache.flags import FlagError, given_flags, int_between
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    raise SystemExit(130) from None

# Engine flags this bench sets per tier and prefix length itself (run_tier), and why.
SET_PER_TIER = {
    "num_pages": "L1 holds one prefix and not two (run_tier sizes it)",
    "enable_hicache": "hicache is on for the l2 and l3 tiers and off for none",
    "hicache_ratio": "L2 is sized per tier",
    "hicache_size": "L2 is sized per tier",
    "hicache_storage_ratio": "L3 is sized per tier",
    "hicache_storage_size": "L3 is sized per tier",
    "hicache_policy": "policy always forces each tier",
    "max_batch": "one request at a time",
}


def burst(device: str, ms: float = 100.0) -> None:
    """Keep the GPU busy ~``ms`` so it is at working clocks when the request arrives (an
    idle GPU drops its SM clock; a serving GPU is not idle)."""
    if not device.startswith("cuda"):
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    while True:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        end.record()
        end.synchronize()
        if start.elapsed_time(end) >= ms:
            return


def run_tier(net: torch.nn.Module, args: argparse.Namespace, tier: str, prefix: int) -> dict[str, Any]:
    ps = args.page_size
    pages = -(-(prefix + args.suffix_tokens + args.max_new_tokens) // ps)
    engine = engine_from_args(
        args,
        net,
        num_pages=pages + max(1, pages // 2),  # one prefix fits, two do not
        enable_hicache=tier != "none",
        l2_pages=(3 * pages if tier == "l2" else pages + max(1, pages // 2)) if tier != "none" else 0,
        l3_pages=4 * pages if tier == "l3" else 0,
        policy="always",
        max_batch=1,
    )
    print(f"  {prefix} tokens, {tier}: running", file=sys.stderr, flush=True)  # a long prefill says nothing
    engine.cache.device.split_layered = args.split_layered
    if args.d2d_runs is not None:
        engine.cache.device.d2d_runs = args.d2d_runs
    if args.d2d_min_bytes is not None:
        engine.cache.device.d2d_min_bytes = args.d2d_min_bytes
    if args.straight_runs is not None:
        engine.cache.device.straight_runs = args.straight_runs
    if args.straight_max_pages is not None:
        engine.cache.device.straight_max_pages = args.straight_max_pages
    rng = random.Random(prefix)
    vocab = int(net.config.vocab_size)  # type: ignore[union-attr, arg-type]
    prefixes = [[rng.randrange(vocab) for _ in range(prefix)] for _ in range(2)]
    check = PageCheck()
    timer = CallTimer(engine)
    ttft: list[float] = []
    waits: list[float] = []  # restore started -> seen published
    prefills: list[float] = []  # the tail's forward and first token
    outputs: list[list[int]] = []
    sources: list[str] = []
    total = 2 * (args.warmup + args.iterations)
    cache_s = 0.0
    walks = 0  # root-to-leaf tree walks inside the timed requests (counted by the tree)
    idle_polls = 0  # steps that only polled and slept (restores in flight, nothing else to run)
    for i in tqdm(range(total), desc=f"{tier} {prefix}", leave=False, disable=None):
        prompt = prefixes[i % 2] + [rng.randrange(vocab) for _ in range(args.suffix_tokens)]
        engine.cache.drain()  # write-through finished before this request arrives
        if args.clock_burst:
            burst(args.device)  # same for every tier: the drain idles the GPU, clocks drop
        before = engine.stats.cache_s
        timer.on = i >= 2 * args.warmup
        walked, idled = engine.cache.core.tree.walks, engine.stats.idle_polls
        out = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
        walked, idled = engine.cache.core.tree.walks - walked, engine.stats.idle_polls - idled
        timer.on = False
        check.observe(engine, i % 2, prompt, prefix // ps, out)
        if i >= 2 * args.warmup:
            ttft.append(out.ttft_s)
            waits.append(out.restore_wait_s)
            prefills.append(out.prefill_s)
            sources.append(served_from(out))
            cache_s += engine.stats.cache_s - before
            walks += walked
            idle_polls += idled
        outputs.append(out.tokens)
    m = engine.cache.metrics
    engine.cache.check_integrity()
    row = {
        "tier": tier,
        "prefix_tokens": prefix,
        "ttft_ms": statistics.median(ttft) * 1e3,
        "cache_ms": cache_s / len(ttft) * 1e3,  # all hicache calls (the engine's own count)
        **timer.per_request_ms(len(ttft)),  # bookkeeping_ms: the same without issuing copies
        "tree_walks_per_request": walks / len(ttft),
        "idle_polls_per_request": idle_polls / len(ttft),
        # TTFT's parts (medians): the restore's wait, the prefill forward, and the rest
        # (hicache calls before the forward, polling, scheduling)
        "restore_wait_ms": statistics.median(waits) * 1e3,
        "prefill_ms": statistics.median(prefills) * 1e3,
        "sources": {s: sources.count(s) for s in set(sources)},
        "gib_per_s": {d: s.gib_per_s for d, s in m.directions.items() if s.count},
        "transfer_ms": {  # means per transfer, warm-up included
            d: {k: getattr(s, f"{k}_s") / s.count * 1e3 for k in ("enqueue", "queue", "service", "total")}
            for d, s in m.directions.items()
            if s.count
        },
        "fallbacks": m.fallbacks,
        "layered_restore": engine.layered,
        "settings": engine_settings(engine),
        "layered_prefills_used": engine.stats.layered_used,
        "graph_replays": engine.runner.graph_replays,
        "outputs": outputs,
        **check.to_dict(),
    }
    if tier == "l2":  # after the row took its figures: the floor's own requests are not in them
        row.update(restore_floor(engine, args, prefixes[0], prefix // ps))
        row["floor_ratio"] = row["ttft_ms"] / row["floor_ms"]
    engine.close()
    # NOTE: progress where tqdm draws nothing (not a terminal: logs, CI, the GPU machine)
    print(f"  {prefix} tokens, {tier}: TTFT median {row['ttft_ms']:.2f} ms", file=sys.stderr, flush=True)
    return row


def restore_floor(
    engine: Any, args: argparse.Namespace, prefix: list[int], pages: int, reps: int = 5
) -> dict[str, float]:
    """An L2 restore's floor, measured in this run: the restored bytes at the plain pinned H2D
    rate (``h2d``) and the tail alone (``tail``: the TTFT of the same request with its prefix
    already in L1) pipelined layer group by layer group, so the slower of the two plus the
    faster one's share of the group it cannot overlap: max(h2d + tail's last group, tail +
    h2d's first group). Without a layered restore the two run one after the other. It runs
    after the timed requests and after their row took its figures."""
    rng = random.Random(-len(prefix))  # suffixes of their own (run_tier seeds with the length)
    vocab = int(engine.net.config.vocab_size)
    l1_hit: list[float] = []
    served: list[str] = []
    for _ in range(reps + 1):  # the first puts the prefix in L1 (restored or recomputed)
        engine.cache.drain()
        if args.clock_burst:
            burst(args.device)
        out = engine.generate(
            prefix + [rng.randrange(vocab) for _ in range(args.suffix_tokens)], max_new_tokens=args.max_new_tokens
        )
        l1_hit.append(out.ttft_s)
        served.append(served_from(out))
    nbytes = pages * engine.cache.device.bytes_per_page
    cuda = args.device.startswith("cuda")
    plain: list[float] = []
    if cuda:
        engine.cache.drain()  # the last request's backups are not beside the plain copy
        torch.cuda.synchronize()
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            a.record()
            dev.copy_(host, non_blocking=True)
            b.record()
            b.synchronize()
            plain.append(a.elapsed_time(b) / 1e3)
        del host, dev
    h2d = statistics.median(plain[1:]) if plain else 0.0
    if set(served[1:]) != {"L1"}:
        raise RuntimeError(f"the floor's tail forwards were not L1 hits: {served[1:]}")
    tail = statistics.median(l1_hit[1:])
    if engine.layered:
        groups = engine.cache.device.layer_groups()
        layers = groups[-1][1]
        first, last = (groups[0][1] - groups[0][0]) / layers, (groups[-1][1] - groups[-1][0]) / layers
        floor = max(h2d + tail * last, tail + h2d * first)
    else:
        floor = h2d + tail
    return {"floor_ms": floor * 1e3, "floor_plain_h2d_ms": h2d * 1e3, "floor_tail_forward_ms": tail * 1e3}


def meta_date(stem: Path) -> str:
    return str(json.loads(stem.with_suffix(".json").read_text())["meta"]["date"])


def parser() -> ArgParser:
    """The benchmark's command line (scripts/run.sh routes each option by it)."""
    ap = ArgParser("python bench/bench_hicache.py", __doc__)
    add_engine_args(ap)
    b = ap.add_argument_group("benchmark")
    b.add_argument(
        "--prefix-tokens",
        type=int_between(1, 1_000_000),
        nargs="+",
        default=[350, 1000, 2000, 3500],
        help="prefix lengths",
    )
    b.add_argument("--suffix-tokens", type=int_between(0, 1_000_000), default=8, help="tokens after the prefix")
    b.add_argument("--max-new-tokens", type=int_between(1, 1_000_000), default=1, help="tokens generated per request")
    b.add_argument(
        "--iterations",
        type=at_least(1),
        default=8,
        help="timed alternations of the two prefixes per prefix length and tier (2 requests each)",
    )
    b.add_argument(
        "--warmup",
        type=at_least(1),
        default=2,
        help="untimed alternations first (at least 1: each prefix's first request is a cold recompute)",
    )
    b.add_argument(
        "--tiers", nargs="+", choices=["none", "l2", "l3"], default=["none", "l2", "l3"], help="none: recompute"
    )
    b.add_argument(
        "--no-clock-burst",
        dest="clock_burst",
        action="store_false",
        help="do not warm the GPU up before each request (without this flag it is: clock_burst=%(default)s)",
    )
    b.add_argument(
        "--split-layered",
        action="store_true",
        help="a layered restore's scatters on the transfer engine's kernel stream (TransferEngine.split_layered)",
    )
    b.add_argument(
        "--straight-runs",
        type=at_least(0),
        default=None,
        help="the most page runs a layered restore copies straight into L1 (0: always the ring; "
        "default: TransferEngine's)",
    )
    b.add_argument(
        "--d2d-runs",
        type=at_least(0),
        default=None,
        help="the most runs of L1 pages a layered restore fills by row DMAs out of the ring "
        "(0: the scatter kernel, or straight into L1; default: TransferEngine's)",
    )
    b.add_argument(
        "--d2d-min-bytes",
        type=at_least(0),
        default=None,
        help="the fewest bytes a layered restore moves by row DMAs out of the ring (default: TransferEngine's)",
    )
    b.add_argument(
        "--layer-group",
        type=at_least(1),
        default=None,
        help="the first layer group's size of a layered restore (default: TransferEngine's)",
    )
    b.add_argument(
        "--last-layer-group",
        type=at_least(1),
        default=None,
        help="the last layer group's size of a layered restore (default: TransferEngine's)",
    )
    b.add_argument(
        "--max-layer-group",
        type=at_least(1),
        default=None,
        help="the largest layer group of a layered restore (default: TransferEngine's)",
    )
    b.add_argument(
        "--layer-waits",
        choices=("values", "events"),
        default=None,
        help="a layered restore's forward waits on layer signals (values: launched while the copies are "
        "queued) or CUDA events (launched after them); default: the engine's (model.LAYER_SIGNALS)",
    )
    b.add_argument(
        "--forward-after",
        type=at_least(1),
        default=None,
        help="layer groups of a restore's copy queued before its forward is launched, with value waits "
        "(default: the engine's FORWARD_AFTER_GROUPS)",
    )
    b.add_argument(
        "--straight-max-pages",
        type=at_least(0),
        default=None,
        help="the most pages a layered restore copies straight into L1 (default: TransferEngine's)",
    )
    add_out_args(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    for dest in sorted(given_flags(ap, argv) & set(SET_PER_TIER)):
        warn(f"--{dest.replace('_', '-')} has no effect: {SET_PER_TIER[dest]}")
    short = [p for p in args.prefix_tokens if p < args.page_size]
    if short:
        ap.error(f"--prefix-tokens {short[0]}: less than one page (--page-size {args.page_size}): nothing to restore")
    aligned = [p for p in args.prefix_tokens if p % args.page_size == 0]
    if aligned and not args.suffix_tokens:
        # NOTE: the last prompt token is always computed, so a prompt of whole pages recomputes
        # its last page: the floor's L1-hit forward would not be one
        ap.error(
            f"--suffix-tokens 0: the prefix of {aligned[0]} tokens is whole pages (--page-size {args.page_size}), "
            "so its last page is recomputed; give at least 1 suffix token"
        )
    first = transfer_engine.LAYER_GROUP if args.layer_group is None else args.layer_group
    most = transfer_engine.MAX_LAYER_GROUP if args.max_layer_group is None else args.max_layer_group
    last = transfer_engine.LAST_LAYER_GROUP if args.last_layer_group is None else args.last_layer_group
    if most < max(first, last):
        ap.error(f"--max-layer-group {most} is smaller than the first or last layer group ({first}, {last})")
    if args.layer_group is not None:  # read as each row's engine builds its transfer engine
        transfer_engine.LAYER_GROUP = args.layer_group
    if args.last_layer_group is not None:
        transfer_engine.LAST_LAYER_GROUP = args.last_layer_group
    if args.max_layer_group is not None:
        transfer_engine.MAX_LAYER_GROUP = args.max_layer_group
    if args.layer_waits is not None:  # read as each row's engine builds its model runner
        model_runner.LAYER_SIGNALS = args.layer_waits == "values"
    if args.forward_after is not None:  # read at each signalled restore
        engine_module.FORWARD_AFTER_GROUPS = args.forward_after
    dtype = dtype_of(args)
    try:
        check_flags(args)  # --device, --model: before a model is built
        if "l3" in args.tiers:  # NOTE: the storage flags as the l3 tier's engine reads them, before any tier runs
            check_flags(argparse.Namespace(**{**vars(args), "enable_hicache": True, "hicache_storage_ratio": 1.0}))
        net = build_model(args.model, device=args.device, dtype=dtype)
        rows = [run_tier(net, args, tier, p) for p in args.prefix_tokens for tier in args.tiers]
    except FlagError as exc:
        ap.error(str(exc))
    want = {"none": "recompute", "l2": "L2", "l3": "L3"}
    for r in rows:  # NOTE: a size the tiers were not made for (a prefix of a page or two) may be served elsewhere
        other = {s: n for s, n in r["sources"].items() if s != want[r["tier"]]}
        if other:
            tier, only = r["tier"], want[r["tier"]]
            warn(f"{r['prefix_tokens']} tokens, tier {tier}: requests served from {other}, not only {only}")
    # the settings of a row with hicache (the recompute rows have no transfers or restores)
    settings = next((r["settings"] for r in rows if r["tier"] != "none"), rows[0]["settings"])
    for r in rows:
        del r["settings"]
    base = {r["prefix_tokens"]: r["ttft_ms"] for r in rows if r["tier"] == "none"}
    recompute = {r["prefix_tokens"]: r["outputs"] for r in rows if r["tier"] == "none"}
    for r in rows:
        r["speedup"] = base.get(r["prefix_tokens"], float("nan")) / r["ttft_ms"]
        ref = recompute.get(r["prefix_tokens"])
        r["outputs_differing_from_recompute"] = (
            None if ref is None else sum(a != b for a, b in zip(r.pop("outputs"), ref, strict=True))
        )
    device = device_name(args.device)
    meta = {
        "model": args.model,
        **settings,  # as run (layered_restore: of the first row; each row has its own)
        "attention_cudnn": args.attention_cudnn,
        "iterations": args.iterations,
        "warmup": args.warmup,
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "max_new_tokens": args.max_new_tokens,
        "clock_burst": args.clock_burst and args.device.startswith("cuda"),
        "timing_dependent": [
            "ttft_ms",
            "speedup",
            "restore_wait_ms",
            "prefill_ms",
            "cache_ms",
            "gib_per_s",
            "floor_ms",
            "floor_ratio",
        ],
    }
    stem = write_results(args.out, f"bench_hicache-{args.model}", args.device, meta, rows, args.tag)
    layered = any(r["layered_restore"] for r in rows)
    print(
        f"\nTTFT by tier, {args.model} ({dtype}), {device}, {meta_date(stem)}; "
        f"median of {2 * args.iterations} requests; layered restore {'on' if layered else 'off'}"
    )
    print(
        f"{'prefix':>7} {'tier':>5} {'TTFT ms':>9} {'speed-up':>8} {'bookkeep':>8} {'issue':>6} {'pages ok':>9} "
        f"{'greedy≠':>7} {'wait':>6} {'fwd':>6} {'walks':>5} {'/floor':>6}  prompt KV from / bandwidth GiB/s"
    )
    for r in rows:
        bw = " ".join(f"{d}={v:.1f}" for d, v in r["gib_per_s"].items())
        diff = r["outputs_differing_from_recompute"]
        share = r["bookkeeping_ms"] / base.get(r["prefix_tokens"], float("nan"))
        issue = r["transfer_issue_ms"] / base.get(r["prefix_tokens"], float("nan"))
        ok = f"{r['restores_checked'] - r['page_mismatches']}/{r['restores_checked']}"
        print(
            f"{r['prefix_tokens']:>7} {r['tier']:>5} {r['ttft_ms']:>9.2f} {r['speedup']:>7.2f}x {share:>8.2%} "
            f"{issue:>6.2%} {ok:>9} {diff!s:>7} {r['restore_wait_ms']:>6.2f} {r['prefill_ms']:>6.2f} "
            f"{r['tree_walks_per_request']:>5.1f} {r.get('floor_ratio', float('nan')):>6.2f}  "
            f"{r['sources']} {bw}"
        )
    print("bookkeep: host time in hicache calls per request, less issuing copies (issue), / recompute TTFT;")
    print("pages ok: restored prefixes whose pages hash (xxh3) equal to the pages as computed;")
    print("greedy≠: outputs differing from recompute;")
    print("wait: ms from the restore's start until a poll saw it published; fwd: ms of the prefill forward;")
    print("walks: root-to-leaf tree walks per request (counted);")
    print("/floor: TTFT / its floor: the restored bytes at the plain pinned H2D rate and the tail forward from L1,")
    print("        pipelined by layer group (restore_floor)")
    plot_latency(rows, {**meta, "device": device, "date": meta_date(stem)}, stem)
    results_done(stem)
    print(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    guarded(main)
