"""L3 read/write bandwidth against a plain sequential read/write of the same file.

Qwen3-8B page geometry (2.25 MiB per page). For each mode (buffered / O_DIRECT, checksums on
/ off) and transfer size: H2S and S2H GiB/s end to end (submit to completed ticket), cold
(page cache dropped with ``posix_fadvise(DONTNEED)`` after ``fsync``) and warm, each with
its ratio to one plain ``preadv`` / ``pwrite`` loop over the same byte range of the same
file into the same pinned buffer, measured in the same run. Writes JSON + PNG.

    python bench/storage.py [--dir /path/on/local/disk] [--pages 16 64 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch

from hicache.backends.pools import HostPool
from hicache.backends.storage import StorageBackend, StorageFile
from hicache.core.geometry import KVGeometry

GEOMETRY = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)


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


def plain_read(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.preadv(fd, [view[done:]], done)


def plain_write(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], done)


def measure(backend: StorageBackend, mode: str, n: int, reps: int) -> dict[str, Any]:
    """Every figure for requests of ``n`` pages against one file."""
    gib = 2.0**30
    fd = backend.file.fd
    nbytes = n * backend.file.bytes_per_page
    view = backend.host.bytes[:n].numpy().data.cast("B")
    pages = list(range(n))
    row: dict[str, Any] = {"mode": mode, "pages": n, "bytes": nbytes}

    def plain_w() -> None:
        plain_write(fd, view)
        os.fsync(fd)

    def h2s() -> None:
        backend.write(pages, pages).wait()
        os.fsync(fd)

    def cold() -> None:
        drop_cache(fd)

    row["plain_write_gibs"] = nbytes / gib / timed(plain_w, reps)
    row["h2s_gibs"] = nbytes / gib / timed(h2s, reps)
    row["h2s_ratio"] = row["h2s_gibs"] / row["plain_write_gibs"]
    for temp, before in (("cold", cold), ("warm", None)):
        row[f"plain_read_{temp}_gibs"] = nbytes / gib / timed(lambda: plain_read(fd, view), reps, before)
        row[f"s2h_{temp}_gibs"] = nbytes / gib / timed(lambda: backend.read(pages, pages).wait(), reps, before)
        row[f"s2h_{temp}_ratio"] = row[f"s2h_{temp}_gibs"] / row[f"plain_read_{temp}_gibs"]
    print(f"  {mode} {n} pages done", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path.cwd(), help="a directory on the disk to measure")
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--chunk-pages", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args()
    g = GEOMETRY
    top = max(args.pages)
    host = HostPool(g, top)
    host.bytes.copy_(torch.randint(0, 256, host.bytes.shape, dtype=torch.uint8))
    rows: list[dict[str, Any]] = []
    for direct in (False, True):
        for checksums in (True, False):
            path = args.dir / f"hicache-bench-{os.getpid()}.bin"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                file = StorageFile(g, top, path, direct=direct)
            backend = StorageBackend(
                file, host, workers=args.workers, chunk_pages=args.chunk_pages, checksums=checksums
            )
            mode = ("direct" if file.direct else "buffered") + ("+xxh3" if checksums else "")
            if direct and not file.direct:
                print(f"O_DIRECT refused here: {[str(w.message) for w in caught]}")
            rows.extend(measure(backend, mode, n, args.reps) for n in args.pages)
            backend.close()
            path.unlink()
    meta = {
        "date": date.today().isoformat(),
        "machine": platform.platform(),
        "dir": str(args.dir),
        "geometry": "Qwen3-8B pages (2.25 MiB), bf16",
        "workers": args.workers,
    }
    print(f"\nL3 storage, {meta['date']}, {meta['machine']}, files in {meta['dir']}")
    print(
        f"{'mode':>16} {'pages':>5} {'MiB':>6} {'write':>6} {'H2S':>6} {'ratio':>5} {'read cold':>9} {'S2H cold':>8}"
        f" {'ratio':>5} {'read warm':>9} {'S2H warm':>8} {'ratio':>5}"
    )
    for r in rows:
        cells = [f"{r['mode']:>16}", f"{r['pages']:>5}", f"{r['bytes'] / 2**20:>6.0f}"]
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
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"storage-{meta['date']}-{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key in zip(axes, ("s2h_cold_ratio", "s2h_warm_ratio", "h2s_ratio"), strict=True):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = [(r["pages"], r[key]) for r in rows if r["mode"] == mode]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pages (2.25 MiB each)")
        ax.set_title(f"{key} (hicache / plain)")
        ax.legend(fontsize=7)
    fig.suptitle(f"hicache L3, {meta['date']}, {args.tag}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=100)
    print(f"wrote {stem}.json and .png")


if __name__ == "__main__":
    main()
