"""L3: one local file of fixed page slots, reached with pwrite / preadv (DESIGN.md §6).

    slot s  <->  bytes [s * bytes_per_page, (s + 1) * bytes_per_page)

Pages adjacent on both sides (slot and host page) are coalesced into one extent; each
request runs on a bounded thread pool and completes a ticket. Writes loop over a
``memoryview`` of the pinned host pages, reads ``preadv`` straight into them: no
serialization, no intermediate copies. Every page's xxh3-64 checksum is recorded when it is
written and verified on every read; a mismatch, a short read at end of file, EIO, ENOSPC
or any other OSError fails the ticket (never reported as success).

File safety: with no path, an unnamed file (``O_TMPFILE``, else ``mkstemp`` + ``unlink``)
with mode 0600 that vanishes even if the process is killed. With a path: refuse a directory,
a symlink, a file owned by another user, an unwritable place or too little free space; open
with ``O_NOFOLLOW`` and re-check the opened file (a symlink planted after validation is
never followed); truncate at start, since the metadata is process-local.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash

from hicache.backends.faults import FaultInjector, FaultKind
from hicache.backends.pools import HostPool, check_pages, coalesce
from hicache.backends.ticket import Ticket
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError, PageOwnershipError
from hicache.spec.model import Direction

log = logging.getLogger(__name__)
STORAGE_FAULTS: tuple[FaultKind, ...] = ("eio", "enospc", "short", "eof", "corrupt", "slow")
ALIGN = 4096


class StorageFile:
    """The L3 file: ``slots`` pages of ``geometry.bytes_per_page`` bytes."""

    def __init__(
        self, geometry: KVGeometry, slots: int, path: str | os.PathLike[str] | None = None, *, direct: bool = False
    ) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots <= 0:
            raise ConfigError(f"L3 slots must be a positive int, got {slots!r}")
        self.geometry = geometry
        self.slots = slots
        self.bytes_per_page = geometry.bytes_per_page
        self.size = slots * self.bytes_per_page
        want_direct = direct
        if direct and self.bytes_per_page % ALIGN:
            warnings.warn(
                f"hicache: O_DIRECT needs {ALIGN}-byte pages, got {self.bytes_per_page}; using buffered I/O",
                RuntimeWarning,
                stacklevel=2,
            )
            want_direct = False
        self.path: str | None = None if path is None else os.fspath(path)
        self.fd, self.direct = self._open(want_direct)
        self.closed = False

    def _open(self, direct: bool) -> tuple[int, bool]:
        flag = getattr(os, "O_DIRECT", 0) if direct else 0
        try:
            fd = self._open_flags(flag)
        except OSError as exc:
            if not flag or exc.errno != errno.EINVAL:
                raise
            warnings.warn(
                "hicache: the file system refuses O_DIRECT (tmpfs?); using buffered I/O", RuntimeWarning, stacklevel=3
            )
            return self._open_flags(0), False
        return fd, bool(flag)

    def _open_flags(self, extra: int) -> int:
        if self.path is None:
            return self._open_unnamed(extra)
        p = Path(self.path)
        self._validate(p)
        try:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | extra, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # NOTE: a symlink planted after _validate
                raise ConfigError(f"L3 path {p} became a symlink; refusing to follow it") from exc
            if exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise ConfigError(f"L3 path {p} is not writable: {exc.strerror}") from exc
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"L3 path {p} is not a regular file")
            if st.st_uid != os.geteuid():
                raise ConfigError(f"L3 path {p} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 0)
            os.ftruncate(fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _validate(self, p: Path) -> None:
        if p.is_symlink():
            raise ConfigError(f"L3 path {p} is a symlink; give the real path")
        if p.is_dir():
            raise ConfigError(f"L3 path {p} is a directory; give a file path")
        parent = p.parent if str(p.parent) else Path(".")
        if not parent.is_dir():
            raise ConfigError(f"L3 path {p}: directory {parent} does not exist")
        existing = 0
        if p.exists():
            st = p.lstat()
            if st.st_uid != os.geteuid():
                raise ConfigError(f"L3 path {p} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
            if not os.access(p, os.W_OK):
                raise ConfigError(f"L3 path {p} is not writable")
            existing = st.st_size
        elif not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"L3 path {p}: directory {parent} is not writable")
        vfs = os.statvfs(parent)
        free = vfs.f_bavail * vfs.f_frsize + existing
        if free < self.size:
            raise ConfigError(f"L3 path {p}: needs {self.size} bytes, only {free} free on that file system")

    def _open_unnamed(self, extra: int) -> int:
        directory = tempfile.gettempdir()
        vfs = os.statvfs(directory)
        if vfs.f_bavail * vfs.f_frsize < self.size:
            raise ConfigError(f"L3 temporary file needs {self.size} bytes; {directory} has too little free space")
        tmpfile = getattr(os, "O_TMPFILE", 0)
        fd = -1
        if tmpfile:
            try:
                fd = os.open(directory, os.O_RDWR | tmpfile | os.O_CLOEXEC | extra, 0o600)
            except OSError as exc:
                if exc.errno == errno.EINVAL and extra:
                    raise
                fd = -1
        if fd < 0:
            fd, name = tempfile.mkstemp(prefix="hicache-l3-", dir=directory)  # mode 0600
            os.unlink(name)  # NOTE: unlinked at once: it vanishes even if we are killed
            if extra:
                try:
                    fd2 = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC | extra)
                finally:
                    os.close(fd)
                fd = fd2
        os.ftruncate(fd, self.size)
        return fd

    def offset(self, slot: int) -> int:
        return slot * self.bytes_per_page

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
            self.closed = True


class StorageBackend:
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
    ) -> None:
        if file.geometry != host.geometry:
            raise ConfigError("L3 file and L2 pool have different geometries")
        if workers <= 0:
            raise ConfigError(f"storage workers must be positive, got {workers}")
        if chunk_pages <= 0:
            raise ConfigError(f"storage chunk_pages must be positive, got {chunk_pages}")
        self.chunk_pages = chunk_pages
        self.file = file
        self.host = host
        self.checksums = checksums
        self.faults = faults or FaultInjector()
        self._pages = host.bytes.numpy()  # [pages, bytes_per_page] uint8, shares memory
        self._sums = np.zeros(file.slots, dtype=np.uint64)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hicache-l3")
        self._lock = threading.Lock()
        self.extents = 0
        self.closed = False

    # -- public ------------------------------------------------------------------------------

    @property
    def persistent(self) -> bool:
        """The slot file's metadata is process-local: nothing outlives us."""
        return False

    def write(self, host_pages: Sequence[int], slots: Sequence[int]) -> Ticket:
        """H2S: copy L2 pages into L3 slots (asynchronous)."""
        return self._submit(Direction.H2S, host_pages, slots)

    def read(self, slots: Sequence[int], host_pages: Sequence[int]) -> Ticket:
        """S2H: copy L3 slots into L2 pages (asynchronous). Checksums verified per page."""
        return self._submit(Direction.S2H, host_pages, slots)

    def close(self, *, wait: bool = True) -> None:
        """Drain (``wait``) or cancel queued work, then close the file."""
        if self.closed:
            return
        self.closed = True
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        self.file.close()

    def status(self) -> dict[str, Any]:
        return {
            "slots": self.file.slots,
            "path": self.file.path or "(unnamed)",
            "direct": self.file.direct,
            "checksums": self.checksums,
            "extents": self.extents,
            "faults_injected": dict(self.faults.injected),
        }

    # -- internals ---------------------------------------------------------------------------

    def _submit(self, direction: Direction, host_pages: Sequence[int], slots: Sequence[int]) -> Ticket:
        t0 = time.perf_counter()
        if self.closed:
            raise ConfigError("storage backend is closed")
        if len(host_pages) != len(slots):
            raise PageOwnershipError(f"{direction.name}: {len(host_pages)} host pages for {len(slots)} slots")
        check_pages("L2", host_pages, self.host.num_pages)
        check_pages("L3", slots, self.file.slots)
        ticket = Ticket(direction, len(slots), len(slots) * self.file.bytes_per_page, started=t0)
        if not slots:
            ticket.finish_now(True)
            return ticket
        extents = coalesce(list(host_pages), list(slots))
        ticket.extents = len(extents)
        op: Literal["read", "write"] = "write" if direction is Direction.H2S else "read"
        hp, sl = list(host_pages), list(slots)
        # NOTE: long extents are cut into chunks the pool runs in parallel, so checksums
        # and page copies of one chunk overlap the I/O of the others.
        chunks = [
            [(c, min(end, c + self.chunk_pages))] for first, end in extents for c in range(first, end, self.chunk_pages)
        ]
        if op == "read" and not self.file.direct:
            # NOTE: parallel chunks on one file description defeat the kernel's sequential
            # readahead; announce each extent so it is read ahead whole.
            for first, end in extents:
                os.posix_fadvise(
                    self.file.fd,
                    self.file.offset(sl[first]),
                    (end - first) * self.file.bytes_per_page,
                    os.POSIX_FADV_WILLNEED,
                )
        spans: list[tuple[float, float]] = []
        futures = [self._pool.submit(self._work, op, hp, sl, c, ticket, spans) for c in chunks]
        ticket.timings.enqueue_s = time.perf_counter() - t0

        def check(block: bool) -> bool | None:
            if not block and not all(f.done() for f in futures):
                return None
            ok = all([_outcome(f, ticket) for f in futures])
            if spans:
                ticket.timings.service_s = max(e for _, e in spans) - min(b for b, _ in spans)
                ticket.finished_at = max(e for _, e in spans)
            if ok:
                with self._lock:
                    self.extents += len(extents)
            return ok

        ticket.bind(check)
        return ticket

    def _work(
        self,
        op: Literal["read", "write"],
        hp: list[int],
        sl: list[int],
        extents: list[tuple[int, int]],
        ticket: Ticket,
        spans: list[tuple[float, float]],
    ) -> bool:
        t0 = time.perf_counter()
        try:
            for first, end in extents:
                view = self._pages[hp[first] : hp[first] + (end - first)].data.cast("B")
                offset = self.file.offset(sl[first])
                if op == "write":
                    if self.checksums:
                        sums = [xxhash.xxh3_64_intdigest(self._pages[p]) for p in hp[first:end]]
                    self._pwrite_all(view, offset)
                    if self.checksums:
                        self._sums[sl[first:end]] = sums
                else:
                    self._pread_all(view, offset)
                    if self.checksums:
                        for p, s in zip(hp[first:end], sl[first:end], strict=True):
                            if xxhash.xxh3_64_intdigest(self._pages[p]) != int(self._sums[s]):
                                raise OSError(errno.EIO, f"checksum mismatch in L3 slot {s}")
            return True
        except OSError as exc:
            ticket.error = f"{op} failed: {exc}"
            log.warning("hicache L3 %s failed: %s", op, exc)
            return False
        finally:
            spans.append((t0, time.perf_counter()))

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        fault = self.faults.take("write", STORAGE_FAULTS)
        done = 0
        while done < len(view):
            chunk = view[done:]
            if fault is not None:
                chunk = self._inject(fault, chunk)
            n = os.pwrite(self.file.fd, chunk, offset + done) if len(chunk) else 0
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite made no progress at byte {offset + done}")
            if fault is not None and fault.kind == "corrupt":
                os.pwrite(self.file.fd, bytes([view[done] ^ 0xFF]), offset + done)
            fault = None
            done += n

    def _pread_all(self, view: memoryview, offset: int) -> None:
        fault = self.faults.take("read", STORAGE_FAULTS)
        done = 0
        while done < len(view):
            chunk = view[done:]
            if fault is not None:
                chunk = self._inject(fault, chunk)
            n = os.preadv(self.file.fd, [chunk], offset + done) if len(chunk) else 0
            if n <= 0:
                raise OSError(errno.EIO, f"short read: end of data at byte {offset + done}")
            if fault is not None and fault.kind == "corrupt":
                view[done] ^= 0xFF
            fault = None
            done += n

    @staticmethod
    def _inject(fault: Any, chunk: memoryview) -> memoryview:
        if fault.kind == "eio":
            raise OSError(errno.EIO, "injected EIO")
        if fault.kind == "enospc":
            raise OSError(errno.ENOSPC, "injected ENOSPC")
        if fault.kind == "slow":
            time.sleep(fault.delay_s)
        if fault.kind == "short":
            return chunk[: max(1, len(chunk) // 2 // ALIGN * ALIGN) if len(chunk) > ALIGN else max(1, len(chunk) // 2)]
        if fault.kind == "eof":
            return chunk[:0]
        return chunk


def _outcome(future: Future[bool], ticket: Ticket) -> bool:
    try:
        return future.result()
    except Exception as exc:  # cancelled at close, or an unexpected error: never success
        ticket.error = ticket.error or f"{type(exc).__name__}: {exc}"
        return False
