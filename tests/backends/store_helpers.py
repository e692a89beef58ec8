"""Shared pieces of the L3 store tests: a small geometry, deterministic page bytes, keys."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hicache.backends.pools import HostPool
from hicache.backends.stores import StoreMover, open_storage
from hicache.core.geometry import KVGeometry
from hicache.core.keys import format_seed, page_keys

G = KVGeometry(2, 2, 64, 16, torch.bfloat16)  # 16 KiB pages
KEYS = page_keys(format_seed("store-test", G), list(range(16 * 64)), 16)


def page_bytes(i: int) -> torch.Tensor:
    """The bytes page ``i`` of the test prompt holds (the same in every process)."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 256, (G.bytes_per_page,), dtype=torch.uint8, generator=g)


def fill(host: HostPool, pages: list[int], which: list[int]) -> None:
    for p, i in zip(pages, which, strict=True):
        host.bytes[p].copy_(page_bytes(i))


def dir_store(path: Path, *, slots: int = 32, host_pages: int = 8, **kw: Any) -> StoreMover:
    return open_storage("dir", G, HostPool(G, host_pages), slots=slots, path=path, **kw)


def eventually(cond: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll ``cond`` until true, at most ``timeout_s`` (a liveness bound, not a timing test)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


@contextmanager
def a_forked_child_lives() -> Iterator[None]:
    """A child forked here (a worker pool's) holds every descriptor it inherited until the
    block ends."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hold the inherited descriptors until told to go
        try:
            os.close(w)
            os.read(r, 1)
        finally:
            os._exit(0)
    os.close(r)
    try:
        yield
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


def close_in_a_child(close: Callable[[], None]) -> None:
    """Run ``close`` in a forked child (closing its copies of the parent's descriptors)."""
    child = os.fork()
    if child == 0:
        try:
            close()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
