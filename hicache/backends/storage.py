"""L3 storage: the default ``file`` store and the constructor for every kind.

:func:`open_storage` (``hicache.backends.stores``) builds a :class:`StoreMover` over the
``file``, ``dir`` or ``mooncake`` store from configuration. :class:`StorageBackend` is the
``file`` store's mover built from an open :class:`StorageFile`, as the facade, the tests and
the benchmarks use it.
"""

from __future__ import annotations

from hicache.backends.faults import FaultInjector
from hicache.backends.pools import HostPool
from hicache.backends.stores import open_storage
from hicache.backends.stores.base import PageStatus, StoreTicket
from hicache.backends.stores.file import ALIGN, STORAGE_FAULTS, FileStore, StorageFile
from hicache.backends.stores.mover import StoreMover

__all__ = [
    "ALIGN",
    "STORAGE_FAULTS",
    "PageStatus",
    "StorageBackend",
    "StorageFile",
    "StoreMover",
    "StoreTicket",
    "open_storage",
]


class StorageBackend(StoreMover):
    """H2S (L2 -> L3) and S2H (L3 -> L2) over a :class:`StorageFile` and a :class:`HostPool`."""

    def __init__(
        self,
        file: StorageFile,
        host: HostPool,
        *,
        workers: int = 4,
        chunk_pages: int = 8,
        checksums: bool = True,
        faults: FaultInjector | None = None,
        deadline_s: float | None = 10.0,
        close_timeout_s: float = 5.0,
    ) -> None:
        faults = faults or FaultInjector()
        store = FileStore(file, host, chunk_pages=chunk_pages, checksums=checksums, faults=faults)
        super().__init__(
            store,
            host,
            slots=file.slots,
            workers=workers,
            deadline_s=deadline_s,
            close_timeout_s=close_timeout_s,
            faults=faults,
        )
        self.file = file
        self.checksums = checksums
        self.chunk_pages = chunk_pages
