"""The catalogue of bad inputs and the typed error each gets (docs/RELIABILITY.md).

Each entry builds a fresh object, feeds it one bad value and expects a ``HiCacheError``
subclass whose message names the value; for stateful objects, the state after the refusal
must equal the state before it. ``python -m hicache.testing.bad_inputs`` prints the table.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from hicache.backends.pools import DevicePool, HostPool
from hicache.backends.storage import StorageBackend, StorageFile
from hicache.backends.transfer import TransferEngine
from hicache.core.cache import CacheCore
from hicache.core.cost import CostPriors, Plan
from hicache.core.geometry import DevicePage, KVGeometry, TierSizes
from hicache.errors import (
    ConfigError,
    HandleError,
    HiCacheError,
    MisuseError,
    PageOwnershipError,
)
from hicache.facade import HiCache, HiCacheConfig
from hicache.spec.model import Tier

G = KVGeometry(2, 2, 8, 2, torch.float32)


@dataclass(frozen=True)
class BadInput:
    area: str
    what: str
    run: Callable[[], Any]  # must raise
    error: type[HiCacheError]
    message: str  # a fragment the message must contain
    state: Callable[[], Any] | None = None  # snapshot taken before and after, must be equal


def _inference_zeros(*shape: int) -> torch.Tensor:
    """An inference tensor: torch refuses in-place writes to it outside inference mode."""
    with torch.inference_mode():
        return torch.zeros(*shape)


def _core() -> CacheCore:
    core = CacheCore(2, TierSizes(8, 8, 8))
    pages = core.allocate_l1(2)
    assert pages is not None
    core.insert((1, 2, 3, 4), pages)
    return core


def _cache() -> HiCache:
    return HiCache(HiCacheConfig(G, l1_pages=8, l2_pages=8, l3_pages=8, device="cpu", transfer_backend="torch"))


def _released_lease() -> tuple[CacheCore, Any]:
    core = _core()
    lease = core.lock(core.match((1, 2, 3, 4)).l1)
    core.release(lease)
    return core, lease


def _closed() -> HiCache:
    c = _cache()
    c.close()
    return c


# The catalogue's scratch directories, removed when the process exits (each one's finalizer).
_scratch: list[tempfile.TemporaryDirectory[str]] = []


def _scratch_dir() -> str:
    d = tempfile.TemporaryDirectory(prefix="hicache-bad-inputs-")
    _scratch.append(d)
    return d.name


def _symlink() -> str:
    d = _scratch_dir()
    Path(d, "real").write_bytes(b"")
    os.symlink(Path(d, "real"), Path(d, "link"))
    return str(Path(d, "link"))


def catalogue() -> list[BadInput]:
    core = _core()
    snap = core.snapshot
    cache = _cache()
    released_core, released = _released_lease()
    host = HostPool(G, 4)
    dev = DevicePool.allocate(G, 4, "cpu")
    engine = TransferEngine(dev, host, "torch")
    storage = StorageBackend(StorageFile(G, 4), host)
    closed = _closed()
    req = cache.admit([1, 2, 3, 4])
    cache.release(req)
    live = cache.admit([1, 2, 3, 4])
    running = cache.admit([7, 7])
    pages = cache.allocate(running, 1)
    assert pages is not None
    cache.insert(running, pages)
    state = lambda: (cache.status().to_dict(), live.state, live.cached_len)  # noqa: E731
    return [
        BadInput("geometry", "num_layers = 0", lambda: KVGeometry(0, 2, 8, 2), ConfigError, "num_layers"),
        BadInput("geometry", "head_dim = -8", lambda: KVGeometry(2, 2, -8, 2), ConfigError, "-8"),
        BadInput("geometry", "page_size = 2.5", lambda: KVGeometry(2, 2, 8, 2.5), ConfigError, "2.5"),  # type: ignore[arg-type]
        BadInput("geometry", "page_size = 2**20", lambda: KVGeometry(2, 2, 8, 2**20), ConfigError, "at most 65,536"),
        BadInput(
            "geometry",
            "head_dim = 2**40 (a page past a TiB)",
            lambda: KVGeometry(2, 2, 2**40, 2),
            ConfigError,
            "head_dim",
        ),
        BadInput(
            "geometry",
            "dtype int8 (quantized KV)",
            lambda: KVGeometry(2, 2, 8, 2, torch.int8),
            ConfigError,
            "quantized",
        ),
        BadInput("sizes", "l1_pages = 0", lambda: TierSizes(0), ConfigError, "l1_pages"),
        BadInput(
            "sizes", "L3 without L2", lambda: HiCacheConfig(G, l1_pages=4, l3_pages=4), ConfigError, "L3 needs L2"
        ),
        BadInput(
            "sizes",
            "model_id with a lone surrogate (it has no bytes to seed keys with)",
            lambda: HiCacheConfig(G, l1_pages=4, model_id="m\ud800"),
            ConfigError,
            "encodes to bytes",
        ),
        BadInput(
            "pool",
            "L1 tensor of the wrong shape",
            lambda: DevicePool(G, torch.zeros(2, 3, 4, 2, 2, 8)),
            ConfigError,
            "does not match",
        ),
        BadInput(
            "pool",
            "L1 tensor of the wrong dtype",
            lambda: DevicePool(G, torch.zeros(2, 2, 4, 2, 2, 8, dtype=torch.float16)),
            ConfigError,
            "float16",
        ),
        BadInput(
            "pool",
            "L1 tensor not contiguous",
            lambda: DevicePool(G, torch.zeros(2, 2, 2, 2, 4, 8).transpose(2, 4)),
            ConfigError,
            "contiguous",
        ),
        BadInput(
            "pool",
            "MLA-style latent buffers",
            lambda: DevicePool(G, cast(Any, [torch.zeros(4, 2, 8), torch.zeros(4, 2, 4)])),
            ConfigError,
            "MLA",
        ),
        BadInput(
            "pool",
            "quantized (uint8) L1 pool",
            lambda: DevicePool(G, torch.zeros(2, 2, 4, 2, 2, 8, dtype=torch.uint8)),
            ConfigError,
            "quantized",
        ),
        BadInput(
            "pool",
            "L1 tensor on another device than configured",
            lambda: HiCache(HiCacheConfig(G, l1_pages=4, device="cuda:0"), torch.zeros(2, 2, 4, 2, 2, 8)),
            ConfigError,
            "cuda:0",
        ),
        BadInput("tokens", "empty", lambda: core.match([]), MisuseError, "empty", snap),
        BadInput("tokens", "floats", lambda: core.match([1.5, 2.0]), MisuseError, "1.5", snap),
        BadInput("tokens", "a None among them", lambda: core.match([1, None, 2]), MisuseError, "None", snap),
        BadInput(
            "tokens", "2-D tensor", lambda: core.match(torch.zeros(2, 2, dtype=torch.long)), MisuseError, "(2, 2)", snap
        ),
        BadInput("tokens", "float tensor", lambda: core.match(torch.zeros(4)), MisuseError, "float32", snap),
        BadInput("tokens", "a string", lambda: core.match("hello"), MisuseError, "str", snap),
        BadInput("tokens", "a bytearray", lambda: core.match(bytearray(b"hi")), MisuseError, "bytearray", snap),
        BadInput("tokens", "an int past int64", lambda: core.match([1, 2**63]), MisuseError, "int64 range", snap),
        BadInput("tokens", "an int below int64", lambda: core.match([-(2**63) - 1, 2]), MisuseError, "int64", snap),
        BadInput(
            "tokens",
            "a tensor on the meta device",
            lambda: core.match(torch.zeros(3, dtype=torch.long, device="meta")),
            MisuseError,
            "meta device",
            snap,
        ),
        BadInput(
            "tokens",
            "a sparse tensor",
            lambda: core.match(torch.tensor([1, 2, 3]).to_sparse()),
            MisuseError,
            "sparse",
            snap,
        ),
        BadInput(
            "tokens",
            "a nested tensor",
            lambda: core.match(
                torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])], layout=torch.jagged)
            ),
            MisuseError,
            "nested",
            snap,
        ),
        BadInput(
            "pages",
            "insert: page count not matching the aligned tokens",
            lambda: core.insert((1, 2, 3), []),
            MisuseError,
            "needs 1 pages",
            snap,
        ),
        BadInput(
            "pages",
            "insert: a page given twice",
            lambda: core.insert((5, 6, 7, 8), [DevicePage(7), DevicePage(7)]),
            PageOwnershipError,
            "twice",
            snap,
        ),
        BadInput(
            "pages",
            "insert: a page the caller does not own",
            lambda: core.insert((5, 6), [DevicePage(6)]),
            PageOwnershipError,
            "page 6",
            snap,
        ),
        BadInput(
            "pages",
            "free a page that is not private",
            lambda: core.free_private([DevicePage(0)]),
            PageOwnershipError,
            "page 0",
            snap,
        ),
        BadInput("pages", "D2H with a page out of range", lambda: engine.d2h([0], [99]), PageOwnershipError, "99"),
        BadInput(
            "pages", "D2H with a duplicate destination", lambda: engine.d2h([0, 1], [2, 2]), PageOwnershipError, "twice"
        ),
        BadInput("pages", "D2H with a bool page", lambda: engine.d2h([True], [0]), PageOwnershipError, "bool"),
        BadInput(
            "pages",
            "D2H with pages in a set (no order)",
            lambda: engine.d2h({0}, [1]),  # type: ignore[arg-type]
            PageOwnershipError,
            "got set",
        ),
        BadInput(
            "pages",
            "D2H with a 2-D page tensor",
            lambda: engine.d2h(torch.zeros(1, 1, dtype=torch.int64), [1]),  # type: ignore[arg-type]
            PageOwnershipError,
            "1-D",
        ),
        BadInput("pages", "L3 write to a slot out of range", lambda: storage.write([0], [4]), PageOwnershipError, "4"),
        BadInput(
            "storage", "path is a directory", lambda: StorageFile(G, 2, tempfile.gettempdir()), ConfigError, "directory"
        ),
        BadInput("storage", "path is a symlink", lambda: StorageFile(G, 2, _symlink()), ConfigError, "symlink"),
        BadInput(
            "storage",
            "directory does not exist",
            lambda: StorageFile(G, 2, "/nonexistent/dir/l3.bin"),
            ConfigError,
            "does not exist",
        ),
        BadInput(
            "storage",
            "not enough free space",
            lambda: StorageFile(G, 2**40, Path(_scratch_dir(), "l3.bin")),
            ConfigError,
            "free",
        ),
        BadInput(
            "storage",
            "a deadline past what a wait can take (drain raised OverflowError)",
            lambda: HiCacheConfig(G, l1_pages=4, l2_pages=4, l3_pages=4, storage_deadline_s=1e300),
            ConfigError,
            "up to 1000000000",
        ),
        BadInput(
            "storage",
            "extra config with keys of mixed types",
            lambda: HiCache(
                HiCacheConfig(G, l1_pages=4, l2_pages=4, l3_pages=4, storage_extra=cast(Any, {1: 1, "a": 2}))
            ),
            ConfigError,
            "no extra config",
        ),
        BadInput(
            "names",
            "a cost prior past the float range",
            lambda: CostPriors(host_gib_s=10**400),
            ConfigError,
            "up to 1e300",
        ),
        BadInput(
            "names",
            "a bool as a cost prior",
            lambda: CostPriors(margin=True),
            ConfigError,
            "margin",
        ),
        BadInput(
            "names",
            "a device number past int64",
            lambda: HiCacheConfig(G, l1_pages=4, device=cast(Any, 10**30)),
            ConfigError,
            "device must be",
        ),
        BadInput(
            "names",
            "unknown policy",
            lambda: HiCacheConfig(G, l1_pages=4, policy="sometimes"),
            ConfigError,
            "sometimes",
        ),
        BadInput(
            "names",
            "unknown write policy",
            lambda: HiCacheConfig(G, l1_pages=4, write_policy="later"),
            ConfigError,
            "later",
        ),
        BadInput(
            "names",
            "unknown transfer backend",
            lambda: HiCacheConfig(G, l1_pages=4, transfer_backend=cast(Any, "cuda")),
            ConfigError,
            "cuda",
        ),
        BadInput(
            "handles",
            "release a lease twice",
            lambda: released_core.release(released),
            HandleError,
            "already released",
            released_core.snapshot,
        ),
        BadInput(
            "handles", "release an already released request", lambda: cache.release(req), HandleError, f"#{req.id}"
        ),
        BadInput("handles", "lock a stale match", _stale_lock, HandleError, "stale"),
        BadInput("lifecycle", "use after close()", lambda: closed.admit([1, 2]), MisuseError, "closed"),
        BadInput(
            "lifecycle", "observe_prefill after close()", lambda: closed.observe_prefill(4, 0.1), MisuseError, "closed"
        ),
        BadInput(
            "config",
            "storage_workers = 0 (refused before the L3 file opens)",
            lambda: HiCacheConfig(G, l1_pages=4, l2_pages=4, l3_pages=4, storage_workers=0),
            ConfigError,
            "storage_workers",
        ),
        BadInput(
            "config",
            "storage_workers = 10**9 (no thread is started)",
            lambda: HiCacheConfig(G, l1_pages=4, l2_pages=4, l3_pages=4, storage_workers=10**9),
            ConfigError,
            "1000000000",
        ),
        BadInput(
            "names",
            "a policy that is a list",
            lambda: HiCacheConfig(G, l1_pages=4, policy=["always"]),  # type: ignore[arg-type]
            ConfigError,
            "['always']",
        ),
        BadInput(
            "config",
            "a CPU device number (the host is one device)",
            lambda: HiCacheConfig(G, l1_pages=4, device="cpu:5"),
            ConfigError,
            "one device",
        ),
        BadInput(
            "config",
            "a CUDA device number past the machine's devices",
            lambda: HiCacheConfig(G, l1_pages=4, device=f"cuda:{max(torch.cuda.device_count(), 1) + 7}"),
            ConfigError,
            "CUDA device",
        ),
        BadInput(
            "config",
            "selective_hits = 0",
            lambda: HiCacheConfig(G, l1_pages=4, selective_hits=0),
            ConfigError,
            "selective",
        ),
        BadInput(
            "config",
            "L2 larger than the machine's memory",
            lambda: HiCacheConfig(G, l1_pages=4, l2_pages=10**13),
            ConfigError,
            "host memory",
        ),
        BadInput(
            "pool",
            "L1 tensor that requires grad",
            lambda: HiCache(
                HiCacheConfig(G, l1_pages=4, device="cpu"), torch.zeros(2, 2, 4, 2, 2, 8, requires_grad=True)
            ),
            ConfigError,
            "requires grad",
        ),
        BadInput(
            "pool",
            "L1 tensor made under torch.inference_mode()",
            lambda: HiCache(HiCacheConfig(G, l1_pages=4, device="cpu"), _inference_zeros(2, 2, 4, 2, 2, 8)),
            ConfigError,
            "inference tensor",
        ),
        BadInput(
            "pool",
            "L1 buffer that is a numpy array",
            lambda: HiCache(HiCacheConfig(G, l1_pages=4, device="cpu"), cast(Any, [[0.0]])),
            ConfigError,
            "L1 pool",
        ),
        BadInput(
            "requests",
            "allocate a page count given as a string",
            lambda: cache.allocate(live, cast(Any, "2")),
            MisuseError,
            "'2'",
            state,
        ),
        BadInput("requests", "allocate -1 pages", lambda: cache.allocate(live, -1), MisuseError, "-1", state),
        BadInput(
            "requests",
            "allocate more pages than L1 holds",
            lambda: cache.allocate(live, cache.config.l1_pages + 1),
            MisuseError,
            "can never fit",
            state,
        ),
        BadInput(
            "requests",
            "start_restore with a tier name as plan",
            lambda: cache.start_restore(live, cast(Any, "L2")),
            MisuseError,
            "str",
            state,
        ),
        BadInput(
            "requests",
            "start_restore with a plan whose tier is a name",
            lambda: cache.start_restore(live, Plan(cast(Any, "L2"), 16, 0.0, 0.0, 0.0)),
            MisuseError,
            "'L2'",
            state,
        ),
        BadInput(
            "requests",
            "insert a page the request does not own",
            lambda: cache.insert(live, [DevicePage(5)]),
            PageOwnershipError,
            "private pages",
            state,
        ),
        BadInput(
            "requests",
            "insert a page id that is a list",
            lambda: cache.insert(live, [cast(Any, [5])]),
            PageOwnershipError,
            "page ids must be ints, got [5] (list)",
            state,
        ),
        BadInput(
            "requests",
            "insert twice",
            lambda: cache.insert(running, []),
            MisuseError,
            "running",
            state,
        ),
        BadInput(
            "requests",
            "observe_prefill with NaN seconds",
            lambda: cache.observe_prefill(4, float("nan")),
            MisuseError,
            "nan",
            state,
        ),
        BadInput(
            "requests",
            "note_decode with negative seconds",
            lambda: cache.note_decode(-1.0),
            MisuseError,
            "-1.0",
            state,
        ),
        BadInput(
            "requests",
            "note_decode with a NaN end time",
            lambda: cache.note_decode(1.0, ended=float("nan")),
            MisuseError,
            "ended must be a finite",
            state,
        ),
        BadInput(
            "requests",
            "observe_prefill with 1e308 seconds (the cost model's fits overflowed to NaN)",
            lambda: cache.observe_prefill(4, 1e308),
            MisuseError,
            "[0, 86400]",
            state,
        ),
        BadInput(
            "requests",
            "observe_prefill with 10**200 tokens (the fit overflowed, and failed the next calls)",
            lambda: cache.observe_prefill(10**200, 0.1),
            MisuseError,
            "[1, 2**53]",
            state,
        ),
        BadInput(
            "requests",
            "start_restore with 3 layer events for 2 layers (room was made in L1 first)",
            lambda: cache.start_restore(live, layer_events=[None, None, None]),
            MisuseError,
            "3 layer_events for 2 layers",
            state,
        ),
        BadInput(
            "requests",
            "start_restore with None as every layer event",
            lambda: cache.start_restore(live, layer_events=[None, None]),
            MisuseError,
            "must be events (torch.cuda.Event), got None",
            state,
        ),
        BadInput(
            "requests",
            "start_restore with ints as layer events",
            lambda: cache.start_restore(live, layer_events=[1, 2]),
            MisuseError,
            "must be events",
            state,
        ),
        BadInput(
            "requests",
            "note_decode with an end time past the float range",
            lambda: cache.note_decode(1.0, ended=10**400),
            MisuseError,
            "ended must be a finite",
            state,
        ),
    ]


def _stale_lock() -> None:
    core = _core()
    old = core.match((1, 2, 3, 4)).l1
    core.evict(Tier.L1, 10)
    core.lock(old)


def markdown() -> str:
    rows = ["| area | bad input | error | message contains |", "|---|---|---|---|"]
    for b in catalogue():
        rows.append(f"| {b.area} | {b.what} | `{b.error.__name__}` | `{b.message}` |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m hicache.testing.bad_inputs``: the catalogue as markdown on stdout; 141 when
    the reader went away (piped into ``head``), quietly, as a shell tool does."""
    from hicache.flags import ArgParser

    ArgParser(
        "python -m hicache.testing.bad_inputs", "Print the bad-input catalogue (docs/RELIABILITY.md) as markdown."
    ).parse_args(argv)
    text = markdown()
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
