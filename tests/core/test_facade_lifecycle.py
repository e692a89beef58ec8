"""The facade's hold on what it is given: an L1 pool another open cache uses is refused, a
pool freed under the cache is a typed error at the next copy (not a crash), and a refusal
past opening the L3 store closes the store."""

from __future__ import annotations

import gc
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.backends.pools import HostPool, l1_shape
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError, MisuseError
from hicache.testing.memory_store import MemoryStore
from tests.threads import named, settle

G = KVGeometry(2, 1, 4, 2, torch.float32)


def config(**kw: object) -> HiCacheConfig:
    args: dict[str, object] = dict(geometry=G, l1_pages=4, l2_pages=16, device="cpu")
    args.update(kw)
    return HiCacheConfig(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("second", ["the same tensor", "an overlapping view"])
def test_an_l1_pool_another_open_cache_uses_is_refused(second: str) -> None:
    """Two caches over one pool handed out the same pages and read each other's KV; once the
    first is closed, the pool may be given to another."""
    shape = l1_shape(G, 4)
    n = torch.Size(shape).numel()
    memory = torch.zeros(2 * n)
    buf = memory[:n].view(shape)
    a = HiCache(config(), buf)
    other = buf if second == "the same tensor" else memory[n // 2 : n // 2 + n].view(shape)
    with pytest.raises(ConfigError, match="shares memory with the L1 pool of another open HiCache"):
        HiCache(config(), other)
    HiCache(config(), torch.zeros(l1_shape(G, 4))).close()  # a pool of its own is fine
    HiCache(config(), memory[n:].view(shape)).close()  # and so is the rest of the same memory
    a.close()
    b = HiCache(config(), buf)
    b.close()


def test_the_l1_pool_a_cache_allocated_is_refused_to_another_cache() -> None:
    """A cache's own pool (no ``l1_buffer``) given to a second cache: both would hand out
    the same pages and overwrite each other's KV."""
    a = HiCache(config())
    with pytest.raises(ConfigError, match="shares memory with the L1 pool of another open HiCache"):
        HiCache(config(), a.l1.buffer)
    b = HiCache(config())  # two caches that each allocated a pool are fine
    a.close()
    HiCache(config(), a.l1.buffer).close()  # once closed, its pool may be given to another
    b.close()


def test_a_pool_freed_under_the_cache_is_a_typed_error_at_the_next_copy() -> None:
    """The engine frees its KV pool (``untyped_storage().resize_(0)``): the next copy out of it
    raises MisuseError naming that, where it wrote freed memory (a segfault on CPU)."""
    buf = torch.zeros(l1_shape(G, 4))
    c = HiCache(config(), buf)
    req = c.admit([1, 2, 3, 4, 5])
    pages = c.allocate(req, 2)
    assert pages is not None
    buf.untyped_storage().resize_(0)
    with pytest.raises(MisuseError, match="L1 pool's memory was freed or moved"):
        c.insert(req, pages)  # its write-through backup copies out of L1
    c.close()  # NOTE: and so gives back its claim on that memory, which the allocator may reuse


def test_a_refusal_after_the_store_was_opened_closes_the_store() -> None:
    """A keyed store without a model id is refused after the store was made: the store is
    closed (it kept its resources for the life of the process)."""
    made: list[MemoryStore] = []
    closed: list[MemoryStore] = []

    class Store(MemoryStore):
        def close(self) -> None:
            closed.append(self)
            super().close()

    def build(host: HostPool) -> MemoryStore:
        made.append(Store(host))
        return made[-1]

    settle()
    threads = threading.active_count()
    with pytest.raises(ConfigError, match="model_id"):
        HiCache(config(l3_pages=8), store=build)
    assert len(made) == 1 and closed == made
    assert threading.active_count() == threads


def l3_threads() -> int:
    return named("hicache-l3-")


def test_a_cache_dropped_without_close_releases_its_storage(tmp_path: Path) -> None:
    """A cache with L3 storage that is collected unclosed closes its store (on a thread of
    its own), with a ResourceWarning: its I/O threads end and the dir store's lock goes, so
    another cache can open the directory. A closed cache warns of nothing."""
    settle()
    before = l3_threads()
    kw = dict(l3_pages=8, storage_backend="dir", storage_path=str(tmp_path / "l3"), model_id="m")
    cache = HiCache(config(**kw))
    assert l3_threads() > before
    with pytest.raises(ConfigError):
        HiCache(config(**kw))  # the directory is locked by the open cache
    with pytest.warns(ResourceWarning, match="not closed"):
        del cache
        gc.collect()
    for _ in range(3000):  # closed on a thread of its own: bounded wait for it (30 s at most)
        if l3_threads() == before and not any(t.name == "hicache-l3-close" for t in threading.enumerate()):
            break
        time.sleep(0.01)
    assert l3_threads() == before
    again = HiCache(config(**kw))  # the lock went with the dropped cache
    kept = again.controller  # a controller kept past its facade still has its storage
    del again
    gc.collect()
    assert l3_threads() > before and kept.storage is not None and kept.storage.available
    with warnings.catch_warnings():  # closed, then collected: no warning
        warnings.simplefilter("error")
        kept.close()
        del kept
        gc.collect()
    assert l3_threads() == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the warning raised, as asked
def test_a_dropped_cache_closes_its_storage_under_an_error_warnings_filter(tmp_path: Path) -> None:
    """With warnings turned into errors the ResourceWarning cannot be shown (it is raised
    inside a finalizer), but the storage still closes: the close is started first."""
    settle()
    before = l3_threads()
    kw = dict(l3_pages=8, storage_backend="dir", storage_path=str(tmp_path / "l3"), model_id="m")
    cache = HiCache(config(**kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del cache
        gc.collect()
    for _ in range(3000):  # bounded wait for the close thread (30 s at most)
        if l3_threads() == before and not any(t.name == "hicache-l3-close" for t in threading.enumerate()):
            break
        time.sleep(0.01)
    assert l3_threads() == before
    HiCache(config(**kw)).close()  # the directory's lock went with it


_AT_EXIT = """
import gc, sys, torch, warnings
warnings.simplefilter("ignore")
from hicache import HiCache, HiCacheConfig
from hicache.core.geometry import KVGeometry
G = KVGeometry(2, 1, 8, 2, torch.float32)
kw = dict(l1_pages=8, l2_pages=8, l3_pages=8, device="cpu", transfer_backend="torch")
if sys.argv[2] == "dir":
    kw.update(storage_backend="dir", storage_path=sys.argv[3], model_id="m")
c = HiCache(HiCacheConfig(G, **kw))
r = c.admit([1, 2, 3, 4])
c.insert(r, c.allocate(r, 2))
if sys.argv[1] == "collected":  # its store closes on a thread of its own, still running at exit
    del c, r
    gc.collect()
print("served")
"""


@pytest.mark.parametrize("store", ["file", "dir"])
@pytest.mark.parametrize("how", ["collected", "open"])
def test_a_process_that_never_closed_its_cache_exits_cleanly(how: str, store: str, tmp_path: Path) -> None:
    """A cache with L3 storage never closed, collected before exit or still open at exit:
    the process ends with status 0. A daemon thread still closing the store while the
    interpreter ended aborted it ("terminate called without an active exception"), about
    one run in two; so four runs each."""
    import subprocess
    import sys

    for i in range(4):
        run = subprocess.run(
            [sys.executable, "-c", _AT_EXIT, how, store, str(tmp_path / f"l3-{i}")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (run.returncode, run.stdout.strip()) == (0, "served"), run.stderr[-2000:]
