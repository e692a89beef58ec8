"""A signal's exception (Ctrl-C, a timeout raised from a SIGALRM handler) while a cache
with L3 storage opens or closes. It reaches the caller, and the store's files and lock are
not left held: the same path opens again at once (a close cut short while its I/O hangs:
as soon as that I/O returns), and the pages written before are served bit-exactly."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import hicache.facade as facade_module
from hicache import HiCache, HiCacheConfig
from hicache.backends.stores import file as file_module
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError
from tests.backends.store_helpers import eventually

PS = 2
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PS, dtype=torch.float32)
PROMPT = list(range(9))  # 4 whole pages and a token


class Interrupt(KeyboardInterrupt):
    """Ctrl-C, as Python raises it between two bytecodes."""


def config(tmp_path: Path, backend: str, deadline_s: float | None = None) -> HiCacheConfig:
    path = tmp_path / ("store" if backend == "dir" else "l3.bin")
    return HiCacheConfig(
        GEOMETRY,
        l1_pages=8,
        l2_pages=16,
        l3_pages=32,
        device="cpu",
        policy="always",
        storage_backend=backend,
        storage_path=str(path),
        model_id="m",
        storage_deadline_s=deadline_s,
    )


def page_content(tokens: list[int], page: int, shape: torch.Size) -> torch.Tensor:
    """What the "prefill" writes for page ``page`` of ``tokens``: a function of both."""
    seed = sum(tokens[: (page + 1) * PS]) * 7 + page
    return (torch.arange(shape.numel(), dtype=torch.float32) + seed).view(shape)


def serve(cache: HiCache, tokens: list[int]) -> list[torch.Tensor]:
    """Admit, restore what the cache has, prefill the rest, insert, release; the pages the
    request ended with (its prefix pages, as read from L1)."""
    req = cache.admit(tokens, at_most=len(tokens) - 1)
    cache.restore(req)
    whole = len(tokens) // PS
    pages = cache.allocate(req, -(-len(tokens) // PS) - req.cached_len // PS)
    assert pages is not None
    first = req.cached_len // PS
    for i, p in enumerate(pages[: whole - first]):
        cache.l1.buffer[:, :, p] = page_content(tokens, first + i, cache.l1.buffer[:, :, p].shape)
    cache.insert(req, pages[: whole - first])
    out = [cache.l1.buffer[:, :, p].clone() for p in cache.prefix_pages(req)]
    cache.release(req)
    return out


def opens(cfg: HiCacheConfig) -> bool:
    """Whether a cache opens on ``cfg``'s path now (closed again at once)."""
    try:
        HiCache(cfg).close()
    except ConfigError:
        return False
    return True


def past_deadline(cache: HiCache) -> bool:
    """Polled: an L3 transfer failed by its deadline (its I/O may still run)."""
    cache.poll()
    return bool(cache.status().metrics["l3_deadline_failures"] > 0)


def l3_threads() -> set[threading.Thread]:
    """The L3 I/O threads alive (other tests' hung ones among them)."""
    return {t for t in threading.enumerate() if t.name.startswith("hicache-l3-")}


@pytest.mark.parametrize("backend", ["file", "dir"])
def test_a_close_cut_short_still_closes_the_store(backend: str, tmp_path: Path) -> None:
    """Ctrl-C while close waits for the I/O threads, one in a write hung past its deadline:
    the close stops waiting and the store closes as that write returns; a second close
    returns, the path opens again, and (a dir store) the pages written are restored
    bit-exactly. (The cut short wait for a job's end: tests/backends/test_store_mover.py.)"""
    cfg = config(tmp_path, backend, deadline_s=0.05)
    cache = HiCache(cfg)
    want = serve(cache, PROMPT)  # written through to L2, then L3
    cache.drain()
    cache.faults.add("hang", op="write")
    serve(cache, [50, *PROMPT[1:]])  # another prompt: its L3 write hangs past its deadline
    storage = cache.storage
    assert storage is not None
    assert eventually(lambda: past_deadline(cache))  # the request is told; the I/O still runs
    assert cache.faults.hanging == 1
    joins = []

    def join(timeout: float | None = None) -> None:  # the hung thread's: up to the close timeout
        joins.append(timeout)
        raise Interrupt("close's join")

    for thread in storage._threads:
        thread.join = join  # type: ignore[method-assign]
    with pytest.raises(Interrupt):
        cache.close()
    assert len(joins) == 1  # cut short at the first
    cache.faults.release()  # the hung write returns
    cache.close()  # finishes what the first left
    assert cache.closed
    assert eventually(lambda: opens(cfg)), "the store stays open and locked after a close cut short"
    if backend == "dir":  # NOTE: the file store starts empty at every open
        with HiCache(cfg) as again:
            req = again.admit(PROMPT, at_most=len(PROMPT) - 1)
            assert again.restore(req) and req.cached_len == len(want) * PS  # from L3
            got = [again.l1.buffer[:, :, p] for p in again.prefix_pages(req)]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            again.release(req)
    assert eventually(lambda: not any(t.is_alive() for t in storage._threads))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
@pytest.mark.parametrize("cut", ["dir lock", "format", "file store", "after the controller", "thread start"])
def test_an_open_cut_short_leaves_the_path_free(cut: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C at each step of opening a cache that leaves a resource behind if nothing
    undoes it (the dir store's lock file, its FORMAT being made, the file store past its
    file's open, the end of the set-up, the I/O threads starting): the interrupt reaches
    the caller, and the path opens again at once, with no descriptor or thread left over."""
    backend = "file" if cut == "file store" else "dir"
    cfg = config(tmp_path, backend)
    opens(config(tmp_path / "warm", backend))  # what a first open loads for good (torch, numpy)
    fds, threads, leftover = open_fds(), l3_threads(), []
    fired: list[str] = []

    def once(real: Callable[..., Any], *, after: bool = False) -> Callable[..., Any]:
        def cut_short(*args: Any, **kwargs: Any) -> Any:
            if fired:
                return real(*args, **kwargs)
            fired.append(cut)
            if after:
                leftover.append(real(*args, **kwargs))  # the descriptor the interrupt loses
            raise Interrupt(cut)

        return cut_short

    previous = signal.getsignal(signal.SIGUSR1)
    if cut == "dir lock":
        monkeypatch.setattr(os, "pwrite", once(os.pwrite))  # the lock file's pid, as the lock is taken
    elif cut == "format":
        real_open = os.open

        def format_open(path: Any, *args: Any, **kwargs: Any) -> int:
            return (once(real_open, after=True) if path == "FORMAT.tmp" else real_open)(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", format_open)
    elif cut == "file store":
        monkeypatch.setattr(file_module.FileStore, "__init__", once(file_module.FileStore.__init__))
    elif cut == "after the controller":
        monkeypatch.setattr(facade_module, "_extent", once(facade_module._extent))
    else:

        def handler(signum: int, frame: Any) -> None:
            raise Interrupt(cut)

        signal.signal(signal.SIGUSR1, handler)  # a Python handler that raises, as Ctrl-C's does
        real_start = threading.Thread.start

        def start(thread: threading.Thread) -> None:
            real_start(thread)
            if thread.name.startswith("hicache-l3-") and not fired:
                fired.append(cut)
                signal.raise_signal(signal.SIGUSR1)  # one thread started, the others not yet

        monkeypatch.setattr(threading.Thread, "start", start)
    try:
        with pytest.raises(Interrupt):
            HiCache(cfg)
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGUSR1, previous)
        for fd in leftover:
            os.close(fd)
    assert fired == [cut]
    assert opens(cfg), f"the store stays locked after an open cut short at {cut}"
    assert eventually(lambda: l3_threads() <= threads), "I/O threads left running"
    assert open_fds() <= fds, "a descriptor left open"  # NOTE: <=: other tests' late I/O may close theirs


def test_a_signal_while_close_lets_go_of_late_io_cancels_each_transfer_once(tmp_path: Path) -> None:
    """A signal's handler that raises (a timeout's) while close hands back the pages of an
    L3 write past its deadline: it raises once close is done, each transfer is cancelled
    once, and a second close returns."""
    previous = signal.getsignal(signal.SIGUSR1)

    def handler(signum: int, frame: Any) -> None:
        raise Interrupt("a timeout")

    signal.signal(signal.SIGUSR1, handler)  # set before the cache opens: held by it
    try:
        cfg = config(tmp_path, "dir", deadline_s=0.05)
        cache = HiCache(cfg)
        cache.faults.add("hang", op="write")
        serve(cache, PROMPT)
        assert eventually(lambda: past_deadline(cache))
        storage = cache.storage
        assert storage is not None
        for thread in storage._threads:
            thread.join = lambda timeout=None: None  # type: ignore[method-assign]  # as if it timed out
        cancelled: list[int] = []
        real_cancel = cache.core.cancel

        def cancel(transfer: Any) -> None:
            real_cancel(transfer)
            cancelled.append(transfer.id)
            if len(cancelled) == 1:
                signal.raise_signal(signal.SIGUSR1)

        cache.core.cancel = cancel  # type: ignore[method-assign]
        with pytest.raises(Interrupt):
            cache.close()
        assert cache.closed and len(cancelled) == len(set(cancelled)) >= 1
        cache.close()
        assert len(cancelled) == len(set(cancelled))
        cache.faults.release()
        assert eventually(lambda: opens(cfg))
    finally:
        signal.signal(signal.SIGUSR1, previous)
