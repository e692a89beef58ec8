"""Shared by the benchmarks: where results go, what their JSON records about the run, page
fingerprints (the bit-identity gate), and the timer of hicache's calls."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import re
import select
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import xxhash

import hicache.engine.engine as engine_module
from hicache.engine import Engine, Output
from hicache.flags import strict_float, strict_int

ROOT = Path(__file__).resolve().parent.parent
CURATED = ROOT / "bench" / "results"  # the tracked set the docs cite; written only when asked


def with_defaults(defaults: list[str], argv: list[str]) -> list[str]:
    """``argv`` after the ``defaults`` (``--flag value`` pairs and bare switches) it does not
    give itself: a probe's defaults yield to the user's flags (a flag may be given once)."""
    given = {word.partition("=")[0] for word in argv if word.startswith("--")}
    out: list[str] = []
    for i, word in enumerate(defaults):
        if not word.startswith("--"):
            continue
        value = defaults[i + 1 : i + 2]
        pair = [word, *value] if value and not value[0].startswith("--") else [word]
        if word not in given:
            out += pair
    return [*out, *argv]


def default_out() -> Path:
    """Outside the repository unless asked: ``$HICACHE_BENCH_OUT`` or /tmp/hicache-bench."""
    return Path(os.environ.get("HICACHE_BENCH_OUT", "/tmp/hicache-bench"))


def out_dir(text: str) -> Path:
    """An ``--out`` directory: one that exists and is writable, or one that can be made
    under the nearest existing directory (made when the results are written, so a run
    refused later leaves nothing behind). A path that cannot be one is a flag error before
    any setup or model build, not a traceback at the end of the run."""
    shown = text if text and " " not in text else repr(text)
    if not text:
        raise argparse.ArgumentTypeError(f"{shown}: an empty path (give a directory)")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{shown}: not a directory")
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{shown}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{shown}: {parent} is not writable")
    try:  # NOTE: a file made and dropped: root passes os.access where writes still fail (/sys, /proc)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{shown}: cannot write in {parent}: {exc.strerror or exc}") from None
    return path


def existing_dir(text: str) -> Path:
    """A directory that must already exist and be writable (the disk a benchmark measures)."""
    path = Path(text)
    shown = text if text and " " not in text else repr(text)
    if not text or not path.is_dir():
        raise argparse.ArgumentTypeError(f"{shown}: not an existing directory")
    if not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{shown}: the directory is not writable")
    return path


def _shown(text: str) -> str:
    """A flag's value as typed, quoted where it holds spaces or is empty ("VALUE: reason")."""
    return text if text and text.isprintable() and " " not in text else repr(text)


# The most any count or size flag takes: past 2**63 the libraries fail (tqdm's bars), and a
# count this large never ends anyway.
MOST = 10**12


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``low`` (counts and sizes; 0 or -1 would end in a
    ZeroDivisionError or an empty statistic long after the flag was read), and at most
    :data:`MOST`."""

    def parse(text: str) -> int:
        shown = _shown(text)  # "VALUE: reason", as the engine's flags
        try:
            value = strict_int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown}: not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{shown}: must be at least {low}")
        if value > MOST:
            raise argparse.ArgumentTypeError(f"{shown}: must be at most {MOST}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an int in ``[low, high]`` (a size beyond ``high`` would only run the
    machine out of memory after a long allocation)."""
    least = at_least(low)

    def parse(text: str) -> int:
        value = least(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"{_shown(text)}: must be at most {high}")
        return value

    parse.__name__ = f"int in [{low}, {high}]"
    return parse


def positive_float(text: str) -> float:
    try:
        value = strict_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_shown(text)}: not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: must be a positive number")
    return value


def fraction(text: str) -> float:
    """An argparse type: a rate in [0, 1] (NaN would compare false everywhere: nothing drawn)."""
    shown = _shown(text)
    try:
        value = strict_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown}: not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{shown}: must be a rate in [0, 1]")
    return value


def torch_device(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N`` that this machine has."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: not a torch device (cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: the benchmarks run on cpu or cuda")
    if device.type == "cpu" and device.index not in (None, 0):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: there is one CPU device (cpu)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{_shown(text)}: no CUDA device here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{_shown(text)}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return text


def guarded(main: Callable[[], object]) -> None:
    """Run a benchmark's ``main``: Ctrl-C ends it with "interrupted" (exit 130) and a
    hicache refusal or an OS error with one ``error:`` line (exit 2), not a traceback."""
    from hicache.errors import HiCacheError, is_out_of_memory

    try:
        code = main()
    except KeyboardInterrupt:
        drop_unfinished()
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError as exc:
        if not stdout_gone():
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        # the reader of the output left (``| head``): stop quietly, as a SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None
    except (HiCacheError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except (MemoryError, RuntimeError) as exc:  # torch's allocators raise RuntimeError subclasses
        text = str(exc).strip()
        if not is_out_of_memory(exc):
            raise
        first = text.splitlines()[0] if text else type(exc).__name__
        print(f"error: out of memory: {first}; try fewer or smaller pages", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code if isinstance(code, int) else 0)


def stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader closed it."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def tag_name(text: str) -> str:
    """An argparse type: a file name suffix (checked before the run, not after it). No '.':
    the file names take their ``.json`` and ``.png`` after it."""
    if not text or "." in text or "/" in text or "\0" in text or len(text) > 100:
        raise argparse.ArgumentTypeError(
            f"{_shown(text)}: must be a plain file name part (no '/' or '.', at most 100 characters)"
        )
    return text


def file_stem(text: str) -> str:
    """``text`` (a model given as a checkpoint path, say) as a file name part: every run of
    characters other than letters, digits, '_', '+' and '-' becomes one '_'."""
    return re.sub(r"[^A-Za-z0-9_+-]+", "_", text).strip("_") or "_"


def add_out_args(ap: argparse.ArgumentParser, writes: str = "the JSON and PNG") -> None:
    ap.add_argument("--out", type=out_dir, default=default_out(), help=f"directory for {writes}")
    ap.add_argument(
        "--tag", type=tag_name, default=None, help="file name suffix (default: the device, e.g. h200 or cpu)"
    )


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "triton", "transformers", "hicache"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    out["torch"] = torch.__version__  # the build actually imported (a CUDA or CPU wheel)
    out["cuda"] = torch.version.cuda
    return out


def git_commit() -> str | None:
    """The checkout's commit, ``+dirty`` when it has changes to tracked files; or
    ``$HICACHE_BENCH_COMMIT`` where set: a copy of the working tree (the GPU machine's)
    whose git metadata is not the tree's names a stale commit."""
    given = os.environ.get("HICACHE_BENCH_COMMIT")
    if given:
        return given
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def engine_settings(engine: Engine) -> dict[str, Any]:
    """What the engine actually runs with (a flag can ask for what the device cannot do)."""
    runner = engine.runner
    return {
        "dtype": str(next(engine.net.parameters()).dtype),
        "page_size": engine.page_size,
        "cuda_graphs": runner.graphs_enabled,
        "graph_short_prefills": runner.graph_short_prefills,
        "attention": runner.attention,
        "layered_restore": engine.layered,
        "layer_signals": "values" if runner.signals is not None else "events",
        "forward_after_groups": engine_module.FORWARD_AFTER_GROUPS,
        "prefetch": engine.prefetch,
        "transfer": {
            k: engine.cache.device.status()[k]
            for k in (
                "gather",
                "scatter",
                "split_layered",
                "straight_runs",
                "straight_max_pages",
                "d2d_runs",
                "d2d_min_bytes",
            )
        }
        | {"layer_groups": engine.cache.device.layer_groups()},
    }


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"


def tag_of(device: str) -> str:
    name = device_name(device)
    return "h200" if "H200" in name else name.lower().replace(" ", "-")


def fingerprint(engine: Engine, tokens: list[int], n_pages: int) -> str | None:
    """xxh3 of the L1 bytes of ``tokens``' first ``n_pages`` pages, or None if they are not
    all in L1. Equal fingerprints before saving and after a restore = bit-identical pages."""
    core = engine.cache.core
    hit = core.match(tokens).l1
    pages = core.pages_l1(hit)[:n_pages]
    if len(pages) < n_pages:
        return None
    data = engine.cache.l1.buffer[:, :, pages].contiguous().cpu()
    return xxhash.xxh3_128_hexdigest(data.view(torch.uint8).numpy().tobytes())


class CallTimer:
    """Host time of the engine's hicache calls, split by call, and the part of it spent
    issuing transfers (the device's ``h2d``/``d2h`` and the storage's ``read``/``write``,
    when called from inside one of those calls). The bookkeeping target (docs/RESULTS.md) counts
    match, plan and insert; issuing copies is the transfer's cost, so the two are reported apart.
    Counts only while :attr:`on`; nested calls count once, in the outermost."""

    CALLS = ("poll", "admit", "plan", "start_restore", "restore", "allocate", "prefix_pages", "insert", "release")

    def __init__(self, engine: Engine) -> None:
        self.on = False
        self.calls: dict[str, float] = defaultdict(float)
        self.issue_s = 0.0
        self._depth = 0
        cache = engine.cache
        for name in self.CALLS:
            setattr(cache, name, self._wrap(name, getattr(cache, name), issue=False))
        movers: list[tuple[object, tuple[str, str]]] = [(cache.device, ("h2d", "d2h"))]
        if cache.storage is not None:
            movers.append((cache.storage, ("read", "write")))
        for obj, names in movers:
            for name in names:
                setattr(obj, name, self._wrap(name, getattr(obj, name), issue=True))

    def _wrap(self, name: str, fn: Callable[..., Any], *, issue: bool) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on or (issue and self._depth == 0) or (not issue and self._depth > 0):
                return fn(*args, **kwargs)  # outside a measured call, or nested in one
            self._depth += not issue
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                if issue:
                    self.issue_s += dt
                else:
                    self._depth -= 1
                    self.calls[name] += dt

        return timed

    def per_request_ms(self, requests: int) -> dict[str, Any]:
        total = sum(self.calls.values())
        return {
            "cache_calls_ms": {k: v / requests * 1e3 for k, v in sorted(self.calls.items())},
            "transfer_issue_ms": self.issue_s / requests * 1e3,
            "bookkeeping_ms": (total - self.issue_s) / requests * 1e3,
        }


class PageCheck:
    """Records a prefix's page fingerprint whenever it is computed; checks every restore of
    it against the last one. ``mismatches`` must stay 0."""

    def __init__(self) -> None:
        self.saved: dict[int, str] = {}
        self.checked = 0
        self.mismatches = 0

    def observe(self, engine: Engine, key: int, tokens: list[int], n_pages: int, out: Output) -> None:
        fp = fingerprint(engine, tokens, n_pages)
        if fp is None or out.error is not None:
            return
        if out.restored_from in ("L2", "L3") and key in self.saved:
            self.checked += 1
            self.mismatches += fp != self.saved[key]
        elif out.cached_tokens < n_pages * engine.page_size:  # this request computed them
            self.saved[key] = fp

    def to_dict(self) -> dict[str, int]:
        return {"restores_checked": self.checked, "page_mismatches": self.mismatches}


# Result files being written: a Ctrl-C before the run's last one (its PNG) removes them all,
# so no JSON is left looking complete beside a PNG that is missing or cut short.
_UNFINISHED: set[Path] = set()


def unfinished(stem: Path) -> None:
    """``stem``'s ``.json`` and ``.png`` are being written (:func:`guarded` removes them on Ctrl-C)."""
    _UNFINISHED.add(stem)


def results_done(stem: Path) -> None:
    """``stem``'s result files are complete."""
    _UNFINISHED.discard(stem)


def drop_unfinished() -> None:
    for stem in list(_UNFINISHED):
        for suffix in (".json", ".png"):
            with contextlib.suppress(OSError):
                stem.with_suffix(suffix).unlink(missing_ok=True)
    _UNFINISHED.clear()


def write_results(
    out: Path, stem: str, device: str, meta: dict[str, Any], rows: list[dict[str, Any]], tag: str | None = None
) -> Path:
    """``out/stem-DATE-TAG.json`` with the run's environment in ``meta``; returns the path
    without suffix (for the PNG), unfinished until :func:`results_done` says so."""
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.now(UTC)
    meta = {
        "date": now.date().isoformat(),
        "time_utc": now.isoformat(timespec="seconds"),
        "device": device_name(device),
        "commit": git_commit(),
        "versions": versions(),
        **meta,
    }
    path = out / f"{file_stem(stem)}-{meta['date']}-{tag or tag_of(device)}"
    doc = finite({"meta": meta, "rows": rows})
    unfinished(path)
    path.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str, allow_nan=False))
    return path


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None, so the JSON written is
    JSON (``NaN`` is not): a figure with nothing to compare against is null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
