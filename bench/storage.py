"""L3 bandwidth against plain reads/writes of the same bytes, and the caller thread's cost.

Qwen3-8B page geometry (2.25 MiB per page). Three parts, all in one run:

- ``file`` store, per mode (buffered / O_DIRECT, checksums on / off) and size: H2S and S2H
  GiB/s end to end (submit to completed ticket), cold (page cache dropped with ``fsync`` +
  ``posix_fadvise(DONTNEED)``: needs no privilege, and on O_DIRECT the cache is bypassed
  anyway) and warm, each with its ratio to one plain ``preadv`` / ``pwrite`` loop over the
  same byte range of the same file into the same host buffer (the two timed in turn, the
  ratio the median of the turns': :func:`paired`).
- ``dir`` store: the same against a plain write/read of one file per page.
- caller: the scheduler thread's time per page inside ``read``/``write`` and the
  ``poll`` calls until completion (wall and CPU), with 1 ms of Python work between polls as
  an engine loop has, for consecutive and fragmented host pages; and the share of that
  loop's own throughput left to it while the I/O threads run. Also ``page_keys`` for a
  3,500-token prompt (219 pages).

    python bench/storage.py [--dir /path/on/local/disk] [--pages 16 64 256] [--caller-pages 256 1024] [--out DIR]

Writes JSON (with the commit and versions) and a PNG to ``--out`` (default ``$HICACHE_BENCH_OUT``
or /tmp/hicache-bench), tagged with the device (``--tag``).
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch
from common import add_out_args, at_least, between, existing_dir, git_commit, guarded, tag_of, versions

from hicache.backends.pools import HostPool
from hicache.backends.storage import StorageBackend, StorageFile
from hicache.backends.stores import StoreMover, open_storage
from hicache.core.geometry import KVGeometry
from hicache.core.keys import format_seed, page_keys
from hicache.engine.cli import ArgParser
from hicache.facade import MAX_STORAGE_WORKERS

GEOMETRY = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
GIB = 2.0**30


def drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def timed(fn: Callable[[], Any], reps: int, before: Callable[[], None] | None = None) -> float:
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def paired(
    plain: Callable[[], Any],
    store: Callable[[], Any],
    reps: int,
    plain_before: Callable[[], None] | None = None,
    store_before: Callable[[], None] | None = None,
) -> tuple[float, float, float]:
    """Median seconds of ``plain`` and of ``store``, taken in turn (plain, store, plain, ...),
    and the median of each turn's ratio plain / store: a disk whose rate drifts during the
    run (burst credits, a neighbour) moves both sides of a turn alike, where two blocks of
    samples one after the other would each see a different disk."""
    plain_s, store_s = [], []
    for _ in range(reps):
        plain_s.append(timed(plain, 1, plain_before))
        store_s.append(timed(store, 1, store_before))
    ratios = [p / s for p, s in zip(plain_s, store_s, strict=True)]
    return statistics.median(plain_s), statistics.median(store_s), statistics.median(ratios)


def plain_read(fd: int, view: memoryview, offset: int = 0) -> None:
    done = 0
    while done < len(view):
        done += os.preadv(fd, [view[done:]], offset + done)


def plain_write(fd: int, view: memoryview, offset: int = 0) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def measure_file(backend: StorageBackend, mode: str, n: int, reps: int) -> dict[str, Any]:
    """Every figure for requests of ``n`` pages against one file."""
    fd = backend.file.fd
    nbytes = n * backend.file.bytes_per_page
    view = backend.host.bytes[:n].numpy().data.cast("B")
    pages = list(range(n))
    row: dict[str, Any] = {"store": "file", "mode": mode, "pages": n, "bytes": nbytes}

    def plain_w() -> None:
        plain_write(fd, view)
        os.fsync(fd)

    def h2s() -> None:
        assert backend.write(pages, pages).wait()
        os.fsync(fd)

    def s2h() -> None:
        assert backend.read(pages, pages).wait()

    plain_s, store_s, row["h2s_ratio"] = paired(plain_w, h2s, reps)
    row["plain_write_gibs"], row["h2s_gibs"] = nbytes / GIB / plain_s, nbytes / GIB / store_s
    for temp, before in (("cold", lambda: drop_cache(fd)), ("warm", None)):
        plain_s, store_s, row[f"s2h_{temp}_ratio"] = paired(lambda: plain_read(fd, view), s2h, reps, before, before)
        row[f"plain_read_{temp}_gibs"], row[f"s2h_{temp}_gibs"] = nbytes / GIB / plain_s, nbytes / GIB / store_s
    print(f"  file {mode} {n} pages done", flush=True)
    return row


def measure_dir(root: Path, host: HostPool, n: int, reps: int) -> dict[str, Any]:
    """The dir store (fsync on) against a plain write + fsync / read of one file per page."""
    g = host.geometry
    bpp = g.bytes_per_page
    nbytes = n * bpp
    pages = list(range(n))
    plain_dir = root / "plain"
    plain_dir.mkdir(exist_ok=True)
    names = [plain_dir / f"p{i}" for i in pages]

    def plain_w() -> None:
        for i, name in enumerate(names):
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            plain_write(fd, host.bytes[i].numpy().data.cast("B"))
            os.fdatasync(fd)
            os.close(fd)
        dfd = os.open(plain_dir, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)

    def plain_r() -> None:
        for i, name in enumerate(names):
            fd = os.open(name, os.O_RDONLY)
            plain_read(fd, host.bytes[i].numpy().data.cast("B"))
            os.close(fd)

    def drop(paths: list[Path]) -> Callable[[], None]:
        def run() -> None:
            for p in paths:
                fd = os.open(p, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

        return run

    row: dict[str, Any] = {"store": "dir", "mode": "fsync", "pages": n, "bytes": nbytes}
    row["plain_write_gibs"] = nbytes / GIB / timed(plain_w, reps)
    samples = []
    for rep in range(reps):  # fresh keys each time: a write of stored keys is skipped
        store_dir = root / f"store{rep}"
        s = open_storage("dir", g, host, slots=n, path=store_dir)
        keys = page_keys(format_seed(f"bench{rep}", g), list(range(n * g.page_size)), g.page_size)
        t0 = time.perf_counter()
        assert s.write(pages, pages, keys).wait()
        samples.append(time.perf_counter() - t0)
        s.close()
    row["h2s_gibs"] = nbytes / GIB / statistics.median(samples)
    row["h2s_ratio"] = row["h2s_gibs"] / row["plain_write_gibs"]
    s = open_storage("dir", g, host, slots=n, path=root / "store0")
    keys = page_keys(format_seed("bench0", g), list(range(n * g.page_size)), g.page_size)
    files = sorted((root / "store0").glob("*.page"))

    def s2h() -> None:
        assert s.read(pages, pages, keys).wait()

    for temp, plain_before, store_before in (("cold", drop(names), drop(files)), ("warm", None, None)):
        plain_s, store_s, row[f"s2h_{temp}_ratio"] = paired(plain_r, s2h, reps, plain_before, store_before)
        row[f"plain_read_{temp}_gibs"], row[f"s2h_{temp}_gibs"] = nbytes / GIB / plain_s, nbytes / GIB / store_s
    s.close()
    for p in root.iterdir():
        shutil.rmtree(p)
    print(f"  dir {n} pages done", flush=True)
    return row


def spin(seconds: float) -> int:
    """Python work on the caller's thread (what an engine loop does between polls)."""
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        n += 1
    return n


def caller_cost(s: StoreMover, n: int, reps: int, keys: list[bytes] | None) -> list[dict[str, Any]]:
    """Caller-thread time per page inside read/write + polls, polling every 1 ms."""
    slots = list(range(n))
    fragmented = slots[::2] + slots[1::2]  # every host page its own run
    assert s.write(slots, slots, keys).wait()
    alone = statistics.median(spin(0.1) for _ in range(3)) / 0.1
    rows = []
    for what, host_pages in (("read", slots), ("read", fragmented), ("write", slots)):
        samples = []
        for _ in range(reps):
            c0, w0 = time.thread_time(), time.perf_counter()
            t = s.read(slots, host_pages, keys) if what == "read" else s.write(host_pages, slots, keys)
            submit = (time.perf_counter() - w0, time.thread_time() - c0)
            poll_w = poll_c = 0.0
            work = 0
            start = time.perf_counter()
            while True:
                c0, w0 = time.thread_time(), time.perf_counter()
                done = t.poll()
                poll_w += time.perf_counter() - w0
                poll_c += time.thread_time() - c0
                if done:
                    break
                work += spin(0.001)
            elapsed = time.perf_counter() - start
            assert t.ok, t.error
            samples.append((*submit, poll_w, poll_c, work / elapsed / alone if elapsed > 0.01 else float("nan")))
        med = [statistics.median(x[i] for x in samples) for i in range(5)]
        rows.append(
            {
                "op": what,
                "host_pages": "consecutive" if host_pages is slots else "fragmented",
                "pages": n,
                "submit_us_per_page": med[0] / n * 1e6,
                "submit_cpu_us_per_page": med[1] / n * 1e6,
                "poll_us_per_page": med[2] / n * 1e6,
                "poll_cpu_us_per_page": med[3] / n * 1e6,
                "caller_us_per_page": (med[0] + med[2]) / n * 1e6,
                "caller_throughput_left": med[4],
            }
        )
    return rows


def keys_cost(reps: int = 50) -> float:
    g = GEOMETRY
    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(3_500)]
    seed = format_seed("Qwen/Qwen3-8B", g)
    return timed(lambda: page_keys(seed, tokens, g.page_size), reps) * 1e6


def main() -> None:
    ap = ArgParser("python bench/storage.py", __doc__)
    ap.add_argument("--dir", type=existing_dir, default=Path.cwd(), help="a directory on the disk to measure")
    ap.add_argument("--pages", type=at_least(1), nargs="+", default=[16, 64, 256])
    ap.add_argument("--caller-pages", type=at_least(1), nargs="+", default=[256, 1024])
    ap.add_argument("--stores", nargs="+", default=["file", "dir"], choices=["file", "dir"])
    ap.add_argument("--modes", nargs="+", default=["buffered", "direct"], choices=["buffered", "direct"])
    ap.add_argument("--reps", type=at_least(1), default=3)
    ap.add_argument(
        "--workers", type=between(1, MAX_STORAGE_WORKERS), default=4, help="I/O threads (at most as HiCacheConfig)"
    )
    ap.add_argument("--chunk-pages", type=at_least(1), default=8)
    add_out_args(ap)
    args = ap.parse_args()
    tag = args.tag or tag_of("cuda" if torch.cuda.is_available() else "cpu")
    g = GEOMETRY
    top = max([*args.pages, *args.caller_pages])
    host = HostPool(g, top)
    host.bytes.copy_(torch.randint(0, 256, host.bytes.shape, dtype=torch.uint8))
    rows: list[dict[str, Any]] = []
    caller: list[dict[str, Any]] = []
    work = args.dir / f"hicache-bench-{os.getpid()}"
    work.mkdir()
    try:
        if "file" in args.stores:
            for direct in (m == "direct" for m in args.modes):
                for checksums in (True, False):
                    path = work / "l3.bin"
                    path.unlink(missing_ok=True)  # the last mode's (the file store takes a new or marked file)
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        file = StorageFile(g, top, path, direct=direct)
                    backend = StorageBackend(
                        file, host, workers=args.workers, chunk_pages=args.chunk_pages, checksums=checksums
                    )
                    mode = ("direct" if file.direct else "buffered") + ("+xxh3" if checksums else "")
                    if direct and not file.direct:
                        print(f"O_DIRECT refused here: {[str(w.message) for w in caught]}")
                    rows.extend(measure_file(backend, mode, n, args.reps) for n in args.pages)
                    if checksums and not direct:
                        for n in args.caller_pages:
                            caller.extend({"store": "file", **r} for r in caller_cost(backend, n, args.reps, None))
                    backend.close()
                    path.unlink()
        if "dir" in args.stores:
            rows.extend(measure_dir(work, host, n, args.reps) for n in args.pages)
            for n in args.caller_pages:
                s = open_storage("dir", g, host, slots=n, path=work / "caller", workers=args.workers)
                keys = page_keys(format_seed("caller", g), list(range(n * g.page_size)), g.page_size)
                caller.extend({"store": "dir", **r} for r in caller_cost(s, n, args.reps, keys))
                s.close()
                shutil.rmtree(work / "caller")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {
        "date": date.today().isoformat(),
        "commit": git_commit(),
        "versions": versions(),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "dir": str(args.dir),
        "geometry": "Qwen3-8B pages (2.25 MiB), bf16",
        "workers": args.workers,
        "chunk_pages": args.chunk_pages,
        "page_keys_us_3500_tokens": keys_cost(),
    }
    print(f"\nL3 storage, {meta['date']}, {meta['machine']}, files in {meta['dir']}")
    print(
        f"{'store':>5} {'mode':>14} {'pages':>5} {'MiB':>6} {'write':>6} {'H2S':>6} {'ratio':>5} {'read cold':>9}"
        f" {'S2H cold':>8} {'ratio':>5} {'read warm':>9} {'S2H warm':>8} {'ratio':>5}   (GiB/s)"
    )
    for r in rows:
        cells = [f"{r['store']:>5}", f"{r['mode']:>14}", f"{r['pages']:>5}", f"{r['bytes'] / 2**20:>6.0f}"]
        for key, width in (
            ("plain_write_gibs", 6),
            ("h2s_gibs", 6),
            ("h2s_ratio", 5),
            ("plain_read_cold_gibs", 9),
            ("s2h_cold_gibs", 8),
            ("s2h_cold_ratio", 5),
            ("plain_read_warm_gibs", 9),
            ("s2h_warm_gibs", 8),
            ("s2h_warm_ratio", 5),
        ):
            cells.append(f"{r[key]:>{width}.2f}")
        print(" ".join(cells))
    print("\ncaller thread, us per page (wall; cpu), polling every 1 ms; share of its own work left during the I/O")
    for c in caller:
        print(
            f"{c['store']:>5} {c['op']:>5} {c['host_pages']:>11} {c['pages']:>5}:"
            f" submit {c['submit_us_per_page']:.2f} ({c['submit_cpu_us_per_page']:.2f}),"
            f" polls {c['poll_us_per_page']:.2f} ({c['poll_cpu_us_per_page']:.2f}),"
            f" total {c['caller_us_per_page']:.2f}; work left {c['caller_throughput_left']:.2f}"
        )
    print(f"page_keys, 3,500 tokens (219 pages): {meta['page_keys_us_3500_tokens']:.0f} us")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"storage-{meta['date']}-{tag}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "caller": caller}, indent=1))
    plot(rows, caller, meta, tag, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")


def plot(rows: list[dict[str, Any]], caller: list[dict[str, Any]], meta: dict[str, Any], tag: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    for ax, key in zip(axes[:3], ("s2h_cold_ratio", "s2h_warm_ratio", "h2s_ratio"), strict=True):
        for label in dict.fromkeys(f"{r['store']} {r['mode']}" for r in rows):
            pts = [(r["pages"], r[key]) for r in rows if f"{r['store']} {r['mode']}" == label]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.axhline(0.9, color="red", lw=0.5, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pages (2.25 MiB each)")
        ax.set_title(f"{key} (hicache / plain)")
        ax.legend(fontsize=7)
    ax = axes[3]
    labels = [f"{c['store']} {c['op']} {c['host_pages'][:4]} {c['pages']}" for c in caller]
    ax.barh(labels, [c["caller_us_per_page"] for c in caller])
    ax.set_xlabel("caller-thread us per page (submit + polls)")
    ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"hicache L3, {meta['date']}, {tag}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    guarded(main)
