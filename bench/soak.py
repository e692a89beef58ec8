"""Soak: the reference engine under load, faults and aborts, with resource baselines.

Requests draw shared prefixes (a hot few and a rotating many) plus random suffixes; up to
``--concurrency`` run at once. At a fixed rate a fault is injected into the next storage
operation or device transfer (EIO, ENOSPC, short I/O, EOF, a corrupted byte, a slow disk,
a failed copy), and a random request is aborted wherever it is. Every moved page is
digest-checked (``verify_pages``): a restored page must equal the page as computed.
``check_integrity()`` runs every ``--integrity-every`` requests.

At the end, after a drain: resident memory, open file descriptors, pinned bytes, pending
transfers, leases, private pages and requests are compared with their baseline (taken
after warm-up). Prints a table and writes JSON under ``--out``; exits non-zero on a leak,
an error, a wrong page or a failed integrity check.

    python bench/soak.py --requests 10000            # CPU, tiny model
    python bench/soak.py --model qwen3-4b --device cuda --minutes 5
"""

from __future__ import annotations

import collections
import ctypes
import gc
import os
import random
import sys
import time
import warnings
from typing import Any

import torch
from common import (
    add_out_args,
    at_least,
    device_name,
    engine_settings,
    fraction,
    guarded,
    results_done,
    write_results,
)
from tqdm import tqdm

from hicache.backends.faults import FaultKind
from hicache.engine import Engine
from hicache.engine.cli import ArgParser, add_engine_args, dtype_of, engine_from_args, served_from
from hicache.flags import FlagError, given_flags, positive_float

FAULTS: list[tuple[FaultKind, str]] = [
    ("eio", "read"),
    ("eio", "write"),
    ("enospc", "write"),
    ("short", "read"),
    ("short", "write"),
    ("eof", "read"),
    ("corrupt", "read"),
    ("slow", "read"),
    ("fail", "read"),
    ("fail", "write"),
]


def rss_parts_mib() -> dict[str, float]:
    """RssAnon (heap, anonymous maps), RssFile (mapped files: libraries' pages as they are
    first touched) and RssShmem, MiB, from /proc/self/status."""
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                key, value = line.split(":")
                out[key.lower().replace("rss", "rss_")] = round(int(value.split()[0]) / 1024, 1)
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


def memory_breakdown() -> dict[str, float]:
    """Where anonymous resident memory sits, MiB (counts as counts): glibc malloc in use and
    free in its arenas (``mallinfo2``), Python's allocated blocks, the brk heap and the
    anonymous mappings from /proc/self/smaps, and the CUDA pinned-host allocator's blocks.
    Growth in ``malloc_free`` is fragmentation, in ``malloc_used`` or ``py_blocks`` live
    objects, in ``anon_maps`` without either a non-malloc mapping (driver, JIT)."""
    mib = 2**20
    out: dict[str, float] = {"py_blocks": float(sys.getallocatedblocks())}
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        mi = libc.mallinfo2()
        out["malloc_used"] = round(mi.uordblks / mib, 1)
        out["malloc_free"] = round(mi.fordblks / mib, 1)
        out["malloc_mmapped"] = round(mi.hblkhd / mib, 1)
    except (OSError, AttributeError):  # not glibc >= 2.33
        pass
    heap = anon = 0
    anon_maps = 0
    current: str | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=6)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                path = head[5].strip() if len(head) > 5 else ""
                current = "heap" if path == "[heap]" else ("anon" if not path else None)
                anon_maps += current == "anon"
            elif head[0] == "Rss:" and current is not None:
                kib = int(head[1])
                if current == "heap":
                    heap += kib
                else:
                    anon += kib
    out["heap"] = round(heap / 1024, 1)
    out["anon_maps_rss"] = round(anon / 1024, 1)
    out["anon_maps"] = float(anon_maps)
    if torch.cuda.is_available():
        host = torch.cuda.host_memory_stats()
        out["pinned_host_cached"] = round(host.get("allocated_bytes.current", 0) / mib, 1)
    return out


def object_census() -> tuple[collections.Counter[str], int]:
    """Live GC-tracked objects by type, and the bytes of distinct CPU tensor storages."""
    gc.collect()
    census: collections.Counter[str] = collections.Counter()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # NOTE: isinstance on every live object touches deprecated torch aliases
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            census[type(o).__qualname__] += 1
            if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not o.is_meta:
                st = o.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
    return census, sum(storages.values())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_after_capture(timeline: list[dict[str, float]], final_rss: int) -> int | None:
    """RSS growth from the first sample taken once the CUDA graph count stopped changing to
    the end; None when the count changed at the last sample (or there are no samples)."""
    if not timeline:
        return None
    last = timeline[-1]["graphs"]
    settled = next(i for i, r in enumerate(timeline) if r["graphs"] == last)
    if settled == len(timeline) - 1 and len(timeline) > 1:
        return None
    return final_rss - int(timeline[settled]["rss_mib"] * 2**20)


def resources(engine: Engine) -> dict[str, int]:
    st = engine.cache.status()
    core = st.core
    out = {
        "rss_bytes": rss_bytes(),
        "open_fds": len(os.listdir("/proc/self/fd")),
        "pinned_workspace_bytes": int(st.transfer.get("workspace_pinned_bytes", 0)),
        "idle_workspaces": int(st.transfer.get("workspaces", 0)),
        "pending_transfers": st.pending_backups + st.pending_restores,
        "leases": core.leases,
        "private_l1_pages": core.tiers[0].private,
        "in_flight_pages": sum(t.in_flight for t in core.tiers),
        "requests": st.requests,
    }
    if engine.cuda:
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
    return out


_SIZED_HERE = {"enable_hicache", "hicache_ratio", "hicache_size", "hicache_storage_ratio", "hicache_storage_size"}


def main(argv: list[str] | None = None) -> int:
    ap = ArgParser("python bench/soak.py", __doc__)
    add_engine_args(ap)
    ap.add_argument("--requests", type=at_least(1), default=10_000, help="stop after this many (or --minutes)")
    ap.add_argument("--minutes", type=positive_float, default=None, help="stop after this long")
    ap.add_argument("--warmup", type=at_least(1), default=200, help="requests before the resource baseline")
    ap.add_argument("--concurrency", type=at_least(1), default=6, help="requests in flight at once")
    ap.add_argument("--fault-rate", type=fraction, default=0.05, help="faults injected per request")
    ap.add_argument("--abort-rate", type=fraction, default=0.03, help="aborts per request")
    ap.add_argument("--integrity-every", type=at_least(1), default=100, help="check_integrity() every N requests")
    ap.add_argument("--hot", type=at_least(1), default=3, help="shared prefixes drawn half the time")
    ap.add_argument("--rotating", type=at_least(1), default=24, help="prefixes drawn in rotation otherwise")
    ap.add_argument("--max-prefix-tokens", type=at_least(2), default=None, help="default: 200 on CPU, 2000 on CUDA")
    ap.add_argument("--sample-s", type=positive_float, default=30.0, help="seconds between RSS samples")
    ap.add_argument("--seed", type=at_least(0), default=0, help="seed of the workload, faults and aborts")
    add_out_args(ap, writes="the JSON")
    ap.add_argument("--no-verify-pages", action="store_true", help="skip the per-page digests (for bisecting)")
    ap.set_defaults(num_pages=None)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    # NOTE: the soak sizes L2 and L3 itself (about half the prefixes in L2, all in L3), hicache on
    for dest in sorted(given_flags(ap, argv) & _SIZED_HERE):
        print(
            f"warning: --{dest.replace('_', '-')} has no effect in the soak (it sizes L2 and L3 itself)",
            file=sys.stderr,
        )
    if args.requests <= args.warmup:
        ap.error(f"--requests {args.requests}: must exceed --warmup {args.warmup} (the leak baseline is taken then)")
    cuda = str(args.device).startswith("cuda")
    if args.model == "qwen3-8b" and not cuda:
        args.model = "tiny"
    max_prefix = args.max_prefix_tokens or (2000 if cuda else 200)
    ps = args.page_size
    if max_prefix <= ps:
        ap.error(f"--max-prefix-tokens {max_prefix}: must exceed the page size {ps} (prefixes are a page or more)")
    rng = random.Random(args.seed)
    per = -(-(max_prefix + 64) // ps)
    # L1 holds a few requests' worth, L2 about half the prefixes, L3 all of them (and more).
    l1 = args.num_pages or per * (args.concurrency + 4)
    try:
        engine = engine_from_args(
            args,
            num_pages=l1,
            enable_hicache=True,
            l2_pages=per * (args.hot + args.rotating) // 2,
            l3_pages=per * (args.hot + args.rotating) * 2,
            verify_pages=not args.no_verify_pages,
        )
    except FlagError as exc:
        ap.error(str(exc))
    vocab = int(engine.net.config.vocab_size)  # type: ignore[union-attr, arg-type]
    prefixes = [
        [rng.randrange(vocab) for _ in range(rng.randrange(ps, max_prefix))] for _ in range(args.hot + args.rotating)
    ]
    faults = engine.cache.faults
    counts = {"served": 0, "aborted": 0, "errors": 0, "faults_injected": 0, "restore_failed": 0}
    by_source = {"recompute": 0, "L1": 0, "L2": 0, "L3": 0}
    settings = engine_settings(engine)
    deadline = None if args.minutes is None else time.monotonic() + 60 * args.minutes
    total = args.requests if deadline is None else 10**9
    baseline: dict[str, int] = {}
    census0: collections.Counter[str] = collections.Counter()
    cpu_tensor_bytes0 = 0
    submitted = done = integrity_checks = 0
    t0 = time.perf_counter()
    bar = tqdm(total=None if deadline else total, desc="soak", mininterval=5)
    # RSS over time, with the CUDA graphs captured so far: growth that stops once the
    # graph set stops growing is capture memory, growth that keeps on is a leak.
    timeline: list[dict[str, float]] = []
    next_sample = time.perf_counter()
    while done + counts["aborted"] < total and (deadline is None or time.monotonic() < deadline or done < args.warmup):
        while engine.pending < args.concurrency and submitted < total:
            i = submitted
            p = prefixes[rng.randrange(args.hot)] if rng.random() < 0.5 else prefixes[args.hot + i % args.rotating]
            engine.submit(p + [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))], rng.randrange(1, 8))
            submitted += 1
            if done >= args.warmup and rng.random() < args.fault_rate:
                kind, op = rng.choice(FAULTS)
                faults.add(kind, op=op, delay_s=0.02 if kind == "slow" else 0.0)  # type: ignore[arg-type]
                counts["faults_injected"] += 1
            if done >= args.warmup and rng.random() < args.abort_rate:
                victim = rng.randrange(max(1, submitted - args.concurrency), submitted + 1)
                counts["aborted"] += engine.abort(victim)
        if baseline and time.perf_counter() >= next_sample:
            timeline.append(
                {
                    "t_s": round(time.perf_counter() - t0, 1),
                    "finished": done,
                    "rss_mib": round(rss_bytes() / 2**20, 1),
                    **rss_parts_mib(),
                    **memory_breakdown(),
                    "graphs": engine.runner.graphs_captured,
                }
            )
            next_sample += args.sample_s
        outs = engine.step()
        while outs:
            out = outs.pop(0)
            if out.error == "aborted":
                bar.update(1)
                continue
            done += 1
            bar.update(1)
            if out.error is not None:
                counts["errors"] += 1
                print(f"request {out.id} failed: {out.error}", file=sys.stderr)
                continue
            counts["served"] += 1
            counts["restore_failed"] += out.restore_failed
            by_source[served_from(out)] += 1
            if done % args.integrity_every == 0:
                engine.cache.check_integrity()
                integrity_checks += 1
            if done == args.warmup:  # quiesce, then take the baseline
                outs.extend(engine.run())
                engine.cache.drain()
                faults.clear()
                baseline = resources(engine)
                census0, cpu_tensor_bytes0 = object_census()
    bar.close()
    wall = time.perf_counter() - t0
    faults.clear()  # faults not yet consumed by an operation
    for out in engine.run():
        done += out.error != "aborted"
        counts["served"] += out.error is None
    engine.cache.drain()
    engine.cache.check_integrity()
    integrity_checks += 1
    final = resources(engine)
    census1, cpu_tensor_bytes1 = object_census()
    grown = (census1 - census0).most_common(12) if baseline else []
    m = engine.cache.metrics
    # RSS is reported; the transfer engine keeps its largest idle workspace by design (so
    # pinned workspace bytes may grow once, to the largest transfer's need): at most one.
    exempt = ("rss_bytes", "pinned_workspace_bytes", "idle_workspaces", "cuda_allocated_bytes")
    leaks = {k: (baseline.get(k), v) for k, v in final.items() if k not in exempt and v != baseline.get(k)}
    if final["idle_workspaces"] > 1:
        leaks["idle_workspaces"] = (baseline.get("idle_workspaces"), final["idle_workspaces"])
    rss_growth = final["rss_bytes"] - baseline.get("rss_bytes", final["rss_bytes"])
    row: dict[str, Any] = {
        "requests_finished": done,
        "wall_s": wall,
        **counts,
        "served_from": by_source,
        "fallbacks": m.fallbacks,
        "verified_pages": m.verified_pages,
        "verify_failures": m.verify_failures,
        "transfers_failed": {d: s.failed for d, s in m.directions.items()},
        "faults_consumed": dict(faults.injected),
        "integrity_checks": integrity_checks,
        "baseline": baseline,
        "final": final,
        "rss_growth_bytes": rss_growth,
        "rss_timeline": timeline,
        "rss_growth_after_last_capture_bytes": rss_after_capture(timeline, final["rss_bytes"]),
        "graphs_captured": engine.runner.graphs_captured,
        "layered": {
            "enabled": engine.layered,
            "prefills": engine.stats.layered_prefills,
            "used": engine.stats.layered_used,
        },
        "cost_model": engine.cache.cost.state(),
        "objects_grown": dict(grown),
        "cpu_tensor_bytes": [cpu_tensor_bytes0, cpu_tensor_bytes1],
        "leaks": leaks,
    }
    engine.close()
    final_fds = len(os.listdir("/proc/self/fd"))
    row["open_fds_after_close"] = final_fds
    print(f"\nSoak: {args.model} on {device_name(args.device)}, {done} requests in {wall:.0f} s")
    for k in (
        "served",
        "aborted",
        "errors",
        "faults_injected",
        "restore_failed",
        "fallbacks",
        "verified_pages",
        "verify_failures",
        "integrity_checks",
    ):
        print(f"  {k:<22} {row[k]}")
    print(f"  {'served from':<22} {by_source}")
    lay = row["layered"]
    used = f"{lay['prefills']} launched, {lay['used']} served" if lay["enabled"] else "off"
    print(f"  {'layered restores':<22} {used}")
    cost = row["cost_model"]
    print(f"  {'cost model':<22} policy {cost['policy']}, explored {cost['explored']}")
    for d in ("H2D", "S2H", "D2H", "H2S"):
        if d in cost:
            print(f"  {'  ' + d:<22} {cost[d]}")
    print(f"  {'faults consumed':<22} {row['faults_consumed']}")
    print(f"  {'transfers failed':<22} {row['transfers_failed']}")
    for k, v in final.items():
        print(f"  {k:<22} baseline {baseline.get(k)!s:>14}  final {v!s:>14}")
    print(f"  {'RSS growth':<22} {rss_growth / 2**20:.1f} MiB;  leaks: {leaks or 'none'}")
    after = row["rss_growth_after_last_capture_bytes"]
    print(
        f"  {'RSS after captures':<22} {'n/a' if after is None else f'{after / 2**20:+.1f} MiB'}"
        f" since the last new CUDA graph ({row['graphs_captured']} captured)"
    )
    print(
        "  RSS timeline (s, finished, MiB, anon, file, graphs): "
        + ", ".join(
            f"({r['t_s']:.0f}, {r['finished']:.0f}, {r['rss_mib']:.0f}, {r.get('rss_anon', 0):.0f}, "
            f"{r.get('rss_file', 0):.0f}, {r['graphs']:.0f})"
            for r in timeline
        )
    )
    print(f"  {'objects grown':<22} {dict(grown) or 'none'}")
    print(f"  {'CPU tensor bytes':<22} {row['cpu_tensor_bytes'][0] / 2**20:.1f} -> {cpu_tensor_bytes1 / 2**20:.1f} MiB")
    keys = ("malloc_used", "malloc_free", "malloc_mmapped", "heap", "anon_maps_rss", "anon_maps", "py_blocks")
    if timeline:
        first, last = timeline[0], timeline[-1]
        print(
            f"  {'anon memory':<22} "
            + ", ".join(f"{k} {first.get(k, 0):.0f} -> {last.get(k, 0):.0f}" for k in (*keys, "pinned_host_cached"))
        )
    meta = {
        "model": args.model,
        "dtype": str(dtype_of(args)),
        "page_size": ps,
        "concurrency": args.concurrency,
        "fault_rate": args.fault_rate,
        "abort_rate": args.abort_rate,
        "max_prefix_tokens": max_prefix,
        "verify_pages": not args.no_verify_pages,
        **settings,
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "attention_cudnn": args.attention_cudnn,
    }
    path = write_results(args.out, f"soak-{args.model}", args.device, meta, [row], args.tag)
    results_done(path)
    print(f"wrote {path}.json")
    return 1 if leaks or counts["errors"] or m.verify_failures else 0


if __name__ == "__main__":
    guarded(main)
