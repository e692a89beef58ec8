"""L3 stores behind one batched protocol, and :func:`open_storage`, which builds one.

============  ===========================================  =====  ======
kind          what                                         keyed  shared
============  ===========================================  =====  ======
``file``      one unnamed (or named) file of fixed slots     no     no
``dir``       a persistent directory, one file per page      yes    yes (across restarts)
``mooncake``  Mooncake Store, shared by processes/machines   yes    yes
============  ===========================================  =====  ======
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Literal

from hicache.backends.faults import FaultInjector
from hicache.backends.pools import HostPool
from hicache.backends.stores.base import PageStatus, PageStore, StoreTicket
from hicache.backends.stores.mover import StoreMover, check_mover_config
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError

StoreKind = Literal["file", "dir", "mooncake"]
STORE_KINDS: tuple[StoreKind, ...] = ("file", "dir", "mooncake")
DIR_OPTIONS = ("fsync",)

__all__ = ["STORE_KINDS", "PageStatus", "PageStore", "StoreKind", "StoreMover", "StoreTicket", "open_storage"]


def open_storage(
    kind: StoreKind | str,
    geometry: KVGeometry,
    host: HostPool,
    *,
    slots: int,
    path: str | os.PathLike[str] | None = None,
    extra: Mapping[str, Any] | None = None,
    workers: int = 4,
    chunk_pages: int | None = None,
    checksums: bool = True,
    direct: bool = False,
    faults: FaultInjector | None = None,
    deadline_s: float | None = 10.0,
    deadline_s_per_gib: float = 10.0,
    close_timeout_s: float = 5.0,
    exists_pages: int = 2048,
    exists_timeout_s: float = 0.25,
) -> StoreMover:
    """The L3 mover for ``kind``. Every setting is validated before anything is opened, and
    whatever was opened is closed again if a later step fails.

    ``slots``: the L3 budget in pages (the file's size; the directory's capacity; virtual
    for Mooncake, whose size is the cluster's). ``path``: the file (``file``, optional) or
    directory (``dir``, required). ``extra``: ``dir``: ``{"fsync": bool}``; ``mooncake``:
    SGLang's extra-config keys (:class:`~hicache.backends.stores.mooncake.MooncakeConfig`).
    ``deadline_s + deadline_s_per_gib * GiB``: how long one request may take (None: forever).
    """
    from hicache.backends.stores import mooncake as mc

    if kind not in STORE_KINDS:
        raise ConfigError(f"storage backend must be one of {list(STORE_KINDS)}, got {kind!r}")
    if not isinstance(host, HostPool) or host.geometry != geometry:
        raise ConfigError("L3 needs the L2 pool of the same geometry")
    check_mover_config(slots, workers, deadline_s, deadline_s_per_gib, close_timeout_s, exists_pages, exists_timeout_s)
    chunk = chunk_pages if chunk_pages is not None else (32 if kind == "mooncake" else 8)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 < chunk <= 1024:
        raise ConfigError(f"storage chunk_pages must be an int in [1, 1024], got {chunk!r}")
    options = dict(extra or {})
    faults = faults or FaultInjector()
    opener: Callable[[], PageStore]
    if kind == "file":
        if options:
            raise ConfigError(f"the file store takes no extra config, got {sorted(options, key=repr)}")
        from hicache.backends.stores.file import FileStore, StorageFile

        def opener() -> PageStore:
            file = StorageFile(geometry, slots, path, direct=direct)
            try:
                return FileStore(file, host, chunk_pages=chunk, checksums=checksums, faults=faults)
            except BaseException:  # NOTE: a signal's exception too: the file stays open and locked
                file.close()
                raise

    elif kind == "dir":
        if path is None:
            raise ConfigError("the dir store needs a path (a directory)")
        if direct:
            raise ConfigError("direct I/O is for the file store only")
        unknown = sorted(set(options) - set(DIR_OPTIONS), key=repr)
        if unknown:
            raise ConfigError(f"dir extra config: unknown keys {unknown}; known: {list(DIR_OPTIONS)}")
        fsync = options.get("fsync", True)
        if not isinstance(fsync, bool):
            raise ConfigError(f"dir extra config fsync must be a bool, got {fsync!r}")
        from hicache.backends.stores.dir import DirStore

        opener = partial(DirStore, path, host, capacity=slots, chunk_pages=chunk, fsync=fsync, faults=faults)
    else:
        if path is not None or direct:
            raise ConfigError("the mooncake store takes no path and no direct I/O; give extra config")
        mc_config = mc.MooncakeConfig.from_extra(options)
        mc.check_installed()
        opener = partial(mc.MooncakeStore, mc_config, host, chunk_pages=chunk, faults=faults)
    store = opener()
    try:
        return StoreMover(
            store,
            host,
            slots=slots,
            workers=workers,
            deadline_s=deadline_s,
            deadline_s_per_gib=deadline_s_per_gib,
            close_timeout_s=close_timeout_s,
            exists_pages=exists_pages,
            exists_timeout_s=exists_timeout_s,
            faults=faults,
        )
    except BaseException:
        store.close()
        raise
