"""Throughput under prefix rotation (one request at a time), plus decode overlap.

Rotation: ``--prefixes`` (8) prefixes of ``--prefix-tokens`` (350) tokens in turn, one
request at a time (batch size 1), 1 output token, ``--requests`` (80) timed after
``--warmup-rotations`` (2) untimed rotations. L1 holds ``--l1-prefixes`` (3) of them, so every request misses L1;
tier ``l2``: L2 holds all; tier ``l3``: L2 holds 3 too and L3 holds all, on the local disk
with O_DIRECT (cold: every read goes to the device) and from page cache (tmpfs). Policies:
``always`` and ``never`` are forced, ``cost`` must be within 5% of the better of them
(``cost/best``); ``(same)``: the share of its requests served from where the better forced
policy (by its mean over runs) served them, its decisions free of run-to-run noise.

Overlap: ``--decoders`` requests keep decoding while the rotation requests arrive; with the
overlap loop their restores hide behind decode batches, with ``--disable-hicache-prefetch``
(blocking) decode stalls. Reports the fraction of restore time overlapped with decode. The
untimed part then also runs until the first decoders have been replaced (and one rotation
more), so the CUDA graphs of a turnover's decode batches are captured before the timing.

Every restored prefix's pages are fingerprinted (xxh3) against the pages as computed:
``page_mismatches`` must be 0. Writes JSON + PNG under ``--out`` (default
$HICACHE_BENCH_OUT or /tmp/hicache-bench). Throughput, TTFT and overlap depend on timing,
and so, under the cost policy, do the tiers chosen; page fingerprints do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

try:  # NOTE: these import torch (seconds): Ctrl-C there ends as it does later, one line and 130
    import torch
    from common import (
        PageCheck,
        add_out_args,
        at_least,
        device_name,
        engine_settings,
        existing_dir,
        guarded,
        results_done,
        write_results,
    )
    from plots import plot_stress
    from tqdm import tqdm

    from hicache.engine import Engine, Output, build_model
    from hicache.engine.cli import ArgParser, add_engine_args, check_flags, dtype_of, engine_from_args, served_from
    from hicache.flags import FlagError, int_between
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    raise SystemExit(130) from None

Config = tuple[str, str, str]  # (tier, storage, policy)
SOURCES = {"recompute": "r", "L1": "1", "L2": "2", "L3": "3"}  # served_from -> letter


def configs(storages: list[str]) -> list[Config]:
    out: list[Config] = [("none", "-", "-")]
    out += [("l2", "-", p) for p in ("always", "never", "cost")]
    for storage in storages:
        out += [("l3", storage, p) for p in ("always", "never", "cost")]
    return out


def make_engine(
    net: torch.nn.Module, args: argparse.Namespace, cfg: Config, storage_dir: str | None, decoders: int
) -> Engine:
    """L1 holds ``l1_prefixes`` prefixes (plus room for the decoders): every rotation
    request misses it. Tier l2: L2 holds every prefix. Tier l3: L2 holds as many as L1,
    L3 every prefix, in a file under ``storage_dir`` (O_DIRECT for ``disk``)."""
    tier, storage, policy = cfg
    ps = args.page_size
    per = -(-(args.prefix_tokens + args.suffix_tokens + args.decode_tokens) // ps) + 1
    kw: dict[str, Any] = dict(num_pages=per * (args.l1_prefixes + decoders), enable_hicache=tier != "none")
    kw.update(l2_pages=0, l3_pages=0, policy=policy if tier != "none" else "never")
    if tier == "l2":
        kw.update(l2_pages=per * (args.prefixes + 2))
    elif tier == "l3":
        kw.update(l2_pages=per * args.l1_prefixes, l3_pages=per * (args.prefixes + 2))
        kw.update(storage_direct=storage == "disk")
        if storage_dir is not None:
            path = os.path.join(storage_dir, f".hicache-bench-{os.getpid()}.l3")
            Path(path).unlink(missing_ok=True)  # the last variant's (the file store takes a new or marked file)
            kw.update(storage_path=path)
    return engine_from_args(args, net, **kw)


def rotate(
    engine: Engine, args: argparse.Namespace, prefixes: list[list[int]], decoders: int, desc: str
) -> dict[str, Any]:
    ps = args.page_size
    full = args.prefix_tokens // ps
    check = PageCheck()

    def prompt(i: int) -> list[int]:  # suffix tokens (< 100) never collide with prefix tokens
        rng = random.Random(i)  # a suffix of its own per request number
        return prefixes[i % len(prefixes)] + [rng.randrange(100) for _ in range(args.suffix_tokens)]

    def background() -> None:  # short private prompts that decode for long
        while engine.pending < decoders:
            # NOTE: a fresh prompt per submission: a repeated one would be a cached prompt
            # among fresh ones, a different shape of work.
            rng = random.Random(-1 - engine.stats.submitted)
            engine.submit([rng.randrange(100) for _ in range(32)], args.decode_tokens)

    def serve(i: int) -> Output:  # one rotation request, the decoders kept topped up meanwhile
        if decoders:
            background()
        rid = engine.submit(prompt(i), 1)
        while True:
            if decoders:
                background()
            found = next((o for o in engine.step() if o.id == rid), None)
            if found is not None:
                return found

    # NOTE: untimed rotations first, with the decoders running as in the timed part, so the
    # CUDA graphs its shapes need are captured here (a capture is one-time setup).
    # NOTE: the timed requests are numbered after the untimed ones: a repeated prompt would
    # find its suffix page cached too, a shorter tail (another graph shape) inside the timing.
    # NOTE: with decoders, the untimed part also runs until the first decoders have been
    # replaced, and one rotation more: the decode batches of a turnover (fewer rows while the
    # new decoders prefill one per step) are shapes of their own, captured once.
    warm = args.warmup_rotations * len(prefixes)
    first, replaced = engine.stats.submitted, None
    limit = warm + 2 * args.decode_tokens + 2 * len(prefixes)  # a turnover comes well before
    i = 0
    while i < warm or (decoders and replaced is None and i < limit) or (replaced is not None and i < replaced):
        out = serve(i)
        check.observe(engine, i % len(prefixes), prompt(i), full, out)
        i += 1
        background_submitted = engine.stats.submitted - first - i
        if decoders and replaced is None and background_submitted >= 2 * decoders:
            replaced = i + len(prefixes)
    warm = i
    engine.cache.drain()
    m = engine.cache.metrics
    cache_s0, submitted0 = engine.stats.cache_s, engine.stats.submitted
    steps0 = dataclasses.asdict(engine.stats)
    base = {"restore_s": m.restore_s, "overlapped": m.restore_overlapped_s}
    graphs0 = engine.runner.graphs_captured
    ttft, sources, verify_s = [], [], 0.0
    start_decode = engine.stats.decode_tokens
    t0 = time.perf_counter()
    for i in tqdm(range(warm, warm + args.requests), desc=desc, leave=False, disable=None):
        found = serve(i)
        t1 = time.perf_counter()
        check.observe(engine, i % len(prefixes), prompt(i), full, found)
        verify_s += time.perf_counter() - t1
        ttft.append(found.ttft_s)
        sources.append(served_from(found))
    wall = time.perf_counter() - t0 - verify_s
    # where the wall time went, for comparing scheduling modes (overlap vs blocking)
    steps = {
        k: round(v - steps0[k], 6) if isinstance(v, float) else v - steps0[k]
        for k, v in dataclasses.asdict(engine.stats).items()
        if k
        in (
            "prefills",
            "prefill_s",
            "decode_batches",
            "decode_s",
            "decode_s_while_restoring",
            "prefill_s_while_restoring",
            "idle_s_while_restoring",
            "restore_issue_s",
            "restore_issue_s_beside_decode",
            "restore_issue_s_beside_prefill",
            "layered_launch_s",
            "layered_prefills",
            "idle_polls",
        )
    }
    decode_tokens = engine.stats.decode_tokens - start_decode
    engine.cache.drain()
    engine.cache.check_integrity()
    restore_s = m.restore_s - base["restore_s"]
    overlapped = m.restore_overlapped_s - base["overlapped"]
    return {
        "requests": args.requests,
        "wall_s": wall,
        "req_per_s": args.requests / wall,
        "ttft_ms_median": statistics.median(ttft) * 1e3,
        "ttft_ms_mean": statistics.fmean(ttft) * 1e3,
        "served_from": {s: sources.count(s) for s in SOURCES},
        "sources_in_order": "".join(SOURCES[s] for s in sources),  # one letter per timed request
        "decode_tokens_per_s": decode_tokens / wall,
        "restore_s": restore_s,
        "overlap_fraction": overlapped / restore_s if restore_s else None,
        "fallbacks": m.fallbacks,
        "policy_skips": m.policy_skips,
        "bookkeeping_ms_per_request": (engine.stats.cache_s - cache_s0)
        / max(1, engine.stats.submitted - submitted0)
        * 1e3,
        "gib_per_s": {d: s.gib_per_s for d, s in m.directions.items() if s.count},
        "ttft_ms": [round(t * 1e3, 3) for t in ttft],
        "engine_steps": steps,
        "graphs_captured_timed": engine.runner.graphs_captured - graphs0,  # one-time setup inside the timing
        **check.to_dict(),
    }


def parser() -> ArgParser:
    """The benchmark's command line (scripts/run.sh routes each option by it)."""
    ap = ArgParser("python bench/bench_hicache_stress.py", __doc__)
    add_engine_args(ap)
    b = ap.add_argument_group("benchmark")
    b.add_argument(
        "--prefixes", type=at_least(1), default=8, choices=range(1, 9), metavar="{1..8}", help="prefixes in rotation"
    )
    b.add_argument("--prefix-tokens", type=int_between(1, 1_000_000), default=350, help="tokens per prefix")
    b.add_argument("--suffix-tokens", type=int_between(0, 1_000_000), default=8, help="tokens after the prefix")
    b.add_argument("--requests", type=at_least(1), default=80, help="timed requests per configuration")
    b.add_argument("--l1-prefixes", type=at_least(1), default=3, help="prefixes L1 holds")
    b.add_argument("--warmup-rotations", type=at_least(1), default=2, help="untimed rotations first")
    b.add_argument(
        "--storage", nargs="+", choices=["disk", "pagecache"], default=["disk", "pagecache"], help="where L3 lives"
    )
    b.add_argument(
        "--disk-dir", type=existing_dir, default=None, help="a directory on the local disk for L3 (default: --out)"
    )
    b.add_argument(
        "--decoders", type=at_least(0), default=4, help="background decoders in the overlap variant (0: skip)"
    )
    b.add_argument(
        "--decode-tokens", type=int_between(1, 1_000_000), default=64, help="tokens each background decoder generates"
    )
    b.add_argument("--no-rotation", action="store_true", help="run only the overlap variants")
    b.add_argument(
        "--repeats", type=at_least(1), default=1, help="runs per configuration, round-robin; rows show the median"
    )
    add_out_args(ap)
    return ap


def _times(value: float, base: float) -> str:
    """``value / base`` as ``1.23x``, or ``-`` without a base (no row without hicache ran)."""
    return f"{value / base:.2f}x" if base == base and base else "-"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = parser()
    args = ap.parse_args(argv)
    if args.no_rotation and not args.decoders:
        ap.error("--no-rotation with --decoders 0: nothing to run (the overlap variants need decoders)")
    if args.l1_prefixes >= args.prefixes:
        ap.error(
            f"--l1-prefixes {args.l1_prefixes}: L1 would hold every one of the {args.prefixes} prefixes "
            "(--prefixes), and no request would miss it"
        )
    dtype = dtype_of(args)
    try:
        return run(args, dtype)
    except FlagError as exc:
        ap.error(str(exc))


def run(args: argparse.Namespace, dtype: torch.dtype) -> list[dict[str, Any]]:
    check_flags(args)  # --device, --model: before a model is built
    if args.disk_dir is None:
        args.out.mkdir(parents=True, exist_ok=True)
    args.disk_dir = str(args.out if args.disk_dir is None else args.disk_dir)
    net = build_model(args.model, device=args.device, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = int(net.config.vocab_size)  # type: ignore[union-attr, arg-type]
    prefixes = [torch.randint(100, vocab, (args.prefix_tokens,), generator=gen).tolist() for _ in range(8)]
    prefixes = prefixes[: args.prefixes]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    # (variant, config, decoders, prefetch); with --repeats the whole list runs round-robin
    # (drift spreads over every configuration) and each row is the run of median req/s.
    jobs: list[tuple[str, Config, int, bool]] = [
        ("rotation", cfg, 0, True) for cfg in ([] if args.no_rotation else configs(args.storage))
    ]
    if args.decoders:
        jobs += [(v, ("l2", "-", "always"), args.decoders, v == "overlap") for v in ("overlap", "blocking")]
    runs: list[list[dict[str, Any]]] = [[] for _ in jobs]
    settings: dict[str, Any] = {}
    layered = args.hicache_layered_restore
    for round_ in range(args.repeats):
        for j, (variant, cfg, decoders, prefetch) in enumerate(jobs):
            tier, storage, policy = cfg
            where = {"disk": args.disk_dir, "pagecache": shm}.get(storage)
            args.disable_hicache_prefetch = not prefetch
            args.hicache_layered_restore = layered if prefetch else "off"  # a blocking restore is whole
            try:  # NOTE: the L3 file goes on any exit (in /dev/shm it holds RAM)
                engine = make_engine(net, args, cfg, where, decoders)
                settings = settings or engine_settings(engine)
                desc = f"{tier} {storage} {policy}" if variant == "rotation" else variant
                if args.repeats > 1:
                    desc += f" ({round_ + 1}/{args.repeats})"
                runs[j].append(rotate(engine, args, prefixes, decoders, desc))
                last = runs[j][-1]  # a line per finished run: a later hang or timeout keeps them in the log
                ov = last["overlap_fraction"]
                print(
                    f"ran {desc}: {last['req_per_s']:.1f} req/s, TTFT median {last['ttft_ms_median']:.1f} ms, "
                    f"served {last['served_from']}, overlap {'-' if ov is None else f'{ov:.0%}'}, "
                    f"page mismatches {last['page_mismatches']}",
                    flush=True,
                )
                engine.close()
            finally:
                if where is not None:
                    Path(where, f".hicache-bench-{os.getpid()}.l3").unlink(missing_ok=True)
    args.disable_hicache_prefetch, args.hicache_layered_restore = False, layered
    rows: list[dict[str, Any]] = []
    for (variant, (tier, storage, policy), _, _), results in zip(jobs, runs, strict=True):
        ranked = sorted(results, key=lambda x: x["req_per_s"])
        row: dict[str, Any] = {"variant": variant, "tier": tier, "storage": storage, "policy": policy}
        row.update(ranked[(len(ranked) - 1) // 2])  # the median run (the lower one of two)
        row["req_per_s_runs"] = [x["req_per_s"] for x in results]
        rows.append(row)
    meta = {
        "model": args.model,
        **settings,  # as run; layered_restore and prefetch: of the first configuration
        **{
            k: getattr(args, k)
            for k in (
                "prefixes",
                "prefix_tokens",
                "suffix_tokens",
                "requests",
                "l1_prefixes",
                "decoders",
                "decode_tokens",
                "repeats",
                "attention_cudnn",
            )
        },
        "timing_dependent": ["req_per_s", "ttft_ms_*", "overlap_fraction", "served_from (policy cost)"],
    }
    best: dict[str, float] = {}
    for r in rows:
        if r["variant"] == "rotation" and r["policy"] in ("always", "never"):
            key = f"{r['tier']}/{r['storage']}"
            best[key] = max(best.get(key, 0.0), r["req_per_s"])
    # Which forced policy is better, by the mean over runs (steadier than one run), and how
    # many of the cost policy's requests were served from where that policy served them: the
    # decisions, free of the run-to-run noise in requests/s.
    better: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["variant"] == "rotation" and r["policy"] in ("always", "never"):
            key = f"{r['tier']}/{r['storage']}"
            if key not in better or statistics.fmean(r["req_per_s_runs"]) > statistics.fmean(
                better[key]["req_per_s_runs"]
            ):
                better[key] = r
    for r in rows:
        key = f"{r['tier']}/{r['storage']}"
        cost = r["policy"] == "cost" and key in best
        r["cost_vs_best_forced"] = r["req_per_s"] / best[key] if cost else None
        r["same_sources_as_better_forced"] = (
            sum(min(n, better[key]["served_from"][t]) for t, n in r["served_from"].items()) / r["requests"]
            if cost
            else None
        )
    base = next((r["req_per_s"] for r in rows if r["tier"] == "none"), float("nan"))
    print(
        f"\nStress: {args.prefixes} x {args.prefix_tokens}-token prefixes in rotation, {args.requests} requests, "
        f"{args.model} ({dtype}) on {device_name(args.device)}, {datetime.now(UTC).date()}"
    )
    print(
        f"{'variant':>9} {'tier':>4} {'storage':>9} {'policy':>6} {'req/s':>8} {'vs none':>7} {'TTFT ms':>8} "
        f"{'rec/L1/L2/L3':>13} {'fallbk':>6} {'overlap':>7} {'dec tok/s':>9} {'cost/best (same)':>16} {'pages ok':>9}"
    )
    for r in rows:
        s = r["served_from"]
        ov = "" if r["overlap_fraction"] is None or r["variant"] == "rotation" else f"{r['overlap_fraction']:.0%}"
        cb = (
            ""
            if r["cost_vs_best_forced"] is None
            else f"{r['cost_vs_best_forced']:.3f} ({r['same_sources_as_better_forced']:.0%})"
        )
        print(
            f"{r['variant']:>9} {r['tier']:>4} {r['storage']:>9} {r['policy']:>6} {r['req_per_s']:>8.2f} "
            f"{_times(r['req_per_s'], base):>7} {r['ttft_ms_median']:>8.2f} "
            f"{s['recompute']:>4}/{s['L1']:>2}/{s['L2']:>2}/{s['L3']:>2} "
            f"{r['fallbacks']:>6} {ov:>7} {r['decode_tokens_per_s']:>9.1f} {cb:>16} "
            f"{r['restores_checked'] - r['page_mismatches']:>4}/{r['restores_checked']:<4}"
        )
    for r in rows:
        if r["variant"] != "rotation":  # where each mode's time goes, per timed request
            st, n = r["engine_steps"], r["requests"]
            print(
                f"  {r['variant']}: per request {st['prefills'] / n:.2f} prefills "
                f"({st['prefill_s'] / n * 1e3:.1f} ms), "
                f"{st['decode_batches'] / n:.2f} decode batches ({st['decode_s'] / n * 1e3:.1f} ms), "
                f"{st['idle_polls'] / n:.1f} idle polls, {r['graphs_captured_timed']} graph captures; "
                f"wall {r['wall_s'] / n * 1e3:.1f} ms; "
                f"TTFT mean {r['ttft_ms_mean']:.1f} / max {max(r['ttft_ms']):.1f} ms"
            )
            k = r["served_from"]["L2"] + r["served_from"]["L3"]
            if k and r["restore_s"]:  # a restore's pending time: what ran meanwhile (ms per restore)
                beside = st.get("restore_issue_s_beside_decode", 0.0)
                parts = {  # starting a restore beside a decode batch is inside that batch's time
                    "decode": st["decode_s_while_restoring"],
                    "other prefills": st["prefill_s_while_restoring"],
                    "starting it": max(0.0, st["restore_issue_s"] - beside),  # (float rounding: never -0.0)
                    "idle": st["idle_s_while_restoring"],
                }
                rest = r["restore_s"] - sum(parts.values())
                print(
                    f"    pending {r['restore_s'] / k * 1e3:.1f} ms per restore: "
                    + ", ".join(f"{name} {v / k * 1e3:.1f}" for name, v in parts.items())
                    + f", the rest {rest / k * 1e3:.1f} (polls, joins, first tokens)"
                )
                if st["layered_prefills"]:
                    launch = st["layered_launch_s"] / st["layered_prefills"] * 1e3
                    print(
                        f"    starting it: {launch:.1f} ms per layered prefill launch, the rest starts the copy; "
                        f"{beside / k * 1e3:.1f} ms per restore ran beside a decode batch"
                    )
    path = write_results(args.out, f"bench_hicache_stress-{args.model}", args.device, meta, rows, args.tag)
    plot_stress(rows, json.loads(path.with_suffix(".json").read_text())["meta"], path)
    results_done(path)
    print(f"wrote {path}.json and .png")
    return rows


if __name__ == "__main__":
    guarded(main)
