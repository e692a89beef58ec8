"""An in-memory keyed, shared page store: what a fuzzing machine (or an embedder's test)
uses as a store that gains and loses pages behind the cache's back.

It implements :class:`~hicache.backends.stores.base.PageStore`; :meth:`add` and
:meth:`drop` are the other instances: a page written by someone else appears, a page
evicted by someone else vanishes. Thread-safe (the mover calls it from its I/O threads).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.backends.pools import HostPool
from hicache.backends.stores.base import Op, PageStatus


class MemoryStore:
    kind = "memory"
    keyed = True
    shared = True
    remote = False

    def __init__(self, host: HostPool) -> None:
        self.host = host
        self.pages: dict[bytes, np.ndarray] = {}
        self._lock = threading.Lock()
        self.puts = 0  # pages actually written (a page the store has is not written again)

    # -- the other instances -------------------------------------------------------------------

    def add(self, key: bytes, page: np.ndarray) -> None:
        """Another instance stored ``page`` (uint8, one page of bytes) under ``key``."""
        with self._lock:
            self.pages[key] = page.copy()

    def drop(self, key: bytes) -> bool:
        """Another instance (or the store's eviction) removed ``key``."""
        with self._lock:
            return self.pages.pop(key, None) is not None

    # -- PageStore -------------------------------------------------------------------------------

    def plan(self, op: Op, host_pages: Sequence[int], slots: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
        return [(0, len(host_pages))], len(host_pages)

    def put(self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None) -> list[PageStatus]:
        assert keys is not None
        rows = self.host.bytes.numpy()
        out = []
        with self._lock:
            for page, key in zip(host_pages, keys, strict=True):
                if key in self.pages:
                    out.append(PageStatus.EXISTS)
                else:
                    self.pages[key] = rows[page].copy()
                    self.puts += 1
                    out.append(PageStatus.OK)
        return out

    def get(self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None) -> list[PageStatus]:
        assert keys is not None
        rows = self.host.bytes.numpy()
        out = []
        with self._lock:
            for page, key in zip(host_pages, keys, strict=True):
                data = self.pages.get(key)
                if data is None:
                    out.append(PageStatus.MISSING)
                else:
                    rows[page] = data
                    out.append(PageStatus.OK)
        return out

    def exists(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self.pages:
                n += 1
            return n

    @property
    def available(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"pages": len(self.pages), "puts": self.puts}
