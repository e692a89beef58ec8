"""The ``file`` store: one local file of fixed page slots (DESIGN.md §2, §6).

    slot s  <->  bytes [s * bytes_per_page, (s + 1) * bytes_per_page)

A run of consecutive slots is one file extent, read with one ``preadv`` (or written with one
``pwritev``) whose buffers are the host pages themselves: no serialization, no copies. Every
page's xxh3-64 checksum is recorded when it is written and verified when it is read; keys
are ignored (metadata is process-local).

File safety: with no path, an unnamed file (``O_TMPFILE``, else ``mkstemp`` + ``unlink``)
with mode 0600 that vanishes even if the process is killed. With a path: refuse a directory,
a symlink, a file owned by another user, an unwritable place, too little free space or a
file-size limit below the L3 size; open with ``O_NOFOLLOW`` and ``O_NONBLOCK`` (a FIFO put
there after the checks does not hold the open) and re-check the opened file;
lock it (``flock``) so a second cache cannot truncate a live file; refuse an existing
non-empty file that does not carry the store's mark (:data:`MARK`, an extended attribute
set on the files it makes); truncate at start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from hicache.backends.faults import Fault, FaultInjector, FaultKind
from hicache.backends.pools import HostPool
from hicache.backends.stores import forks
from hicache.backends.stores.base import Op, PageStatus
from hicache.backends.stores.iov import runs, skip
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError

STORAGE_FAULTS: tuple[FaultKind, ...] = ("eio", "enospc", "short", "eof", "corrupt", "slow", "hang")
ALIGN = 4096
IOV_MAX = 1024  # buffers per preadv/pwritev (Linux UIO_MAXIOV)
_OPEN_TRIES = 5  # opens of a named file that another process removed or replaced meanwhile


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
        try:
            self.fd, self.direct = self._open(want_direct)
        except PermissionError as exc:
            raise ConfigError(f"L3 path {self.path or tempfile.gettempdir()}: permission denied ({exc})") from exc
        except OSError as exc:  # a name too long, an I/O error: the path is not usable
            raise ConfigError(f"L3 path {self.path or tempfile.gettempdir()}: {exc.strerror or exc}") from exc
        self.closed = False
        self._opened_by = os.getpid()  # the process that locked the file (close unlocks there only)
        forks.drop_in_children(self)  # NOTE: an unnamed one too: a child must not keep its space allocated

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
        for _ in range(_OPEN_TRIES):
            fd = self._open_named(p, extra)
            if fd is not None:
                return fd
        raise ConfigError(f"L3 path {p} was removed or replaced while this cache opened it, {_OPEN_TRIES} times")

    def _open_named(self, p: Path, extra: int) -> int | None:
        """Open, lock and size the file at ``p``; None if the path no longer names the file
        opened (another process removed or replaced it meanwhile: try again).

        Only a file this call created and locked is removed on a failure: one it merely
        opened, or created and lost the lock of, is another cache's live file (it was made
        between this cache's look and its open)."""
        flags = os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | extra
        try:
            try:
                fd = os.open(p, flags | os.O_CREAT | os.O_EXCL, 0o600)
                created = True
            except FileExistsError:
                fd = os.open(p, flags)
                created = False
        except FileNotFoundError:
            return None  # NOTE: removed between the two opens
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # NOTE: a symlink planted after _validate
                raise ConfigError(f"L3 path {p} became a symlink; refusing to follow it") from exc
            if exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise ConfigError(f"L3 path {p} is not writable: {exc.strerror}") from exc
            raise
        ours = False  # created here, locked, and still at the path: removed again on a failure
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"L3 path {p} is not a regular file")
            if st.st_uid != os.geteuid():
                raise ConfigError(f"L3 path {p} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
            try:
                # NOTE: before truncating: a second cache on the same path must not wipe
                # the pages of a live one.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise ConfigError(f"L3 path {p} is in use by another cache (it is locked); give each its own") from exc
            except OSError:
                ours = created  # NOTE: no lock to be had here (NFS without lockd): no one holds it
                raise
            try:
                now = os.stat(p, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)  # NOTE: a file no one can find again; the one at the path is someone else's
                return None
            ours = created
            if not created and st.st_size and not _marked(fd):
                raise ConfigError(
                    f"L3 path {p} is an existing file of {st.st_size} bytes that hicache did not make (the file "
                    "store overwrites its file at start); give a new path, or delete it if it is yours to lose"
                )
            _mark(fd)  # NOTE: before sizing: a cache killed while it sizes leaves a file known as ours
            _resize(fd, self.size, f"L3 path {p}")
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 0)
            os.ftruncate(fd, self.size)
        except BaseException:
            os.close(fd)
            if ours:
                p.unlink(missing_ok=True)
            raise
        return fd

    def _validate(self, p: Path) -> None:
        if p.is_symlink():
            raise ConfigError(f"L3 path {p} is a symlink; give the real path")
        if p.is_dir():
            raise ConfigError(f"L3 path {p} is a directory; give a file path")
        parent = p.parent if str(p.parent) else Path(".")
        if not parent.is_dir():
            what = "is not a directory" if parent.exists() else "does not exist"  # NOTE: a file there: not "missing"
            raise ConfigError(f"L3 path {p}: directory {parent} {what}")
        vfs = os.statvfs(parent)
        if vfs.f_blocks == 0:  # NOTE: /proc, /sys: "0 free" would send the user looking for space
            raise ConfigError(f"L3 path {p}: on a file system that stores no data (such as /proc); give a disk path")
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
        try:
            _resize(fd, self.size, f"L3 temporary file in {directory}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def offset(self, slot: int) -> int:
        return slot * self.bytes_per_page

    def drop_in_child(self) -> None:
        """In a forked child: close the copy of the locked file (the parent keeps the lock; a
        child outliving a killed parent must not)."""
        if not self.closed:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1  # NOTE: its number may be reused for another file in the child
            self.closed = True

    def close(self) -> None:
        if not self.closed:
            if self.path is not None and os.getpid() == self._opened_by:
                # NOTE: unlocked, not only closed: a child forked meanwhile shares the open
                # file and with it the flock, which closing our descriptor leaves held while
                # the child lives. A child closing its copy must not unlock ours.
                with contextlib.suppress(OSError):
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
            fd, self.fd, self.closed = self.fd, -1, True  # NOTE: first: a child forked meanwhile must not close it
            os.close(fd)


# An extended attribute on the files the store makes at a path: a later store may overwrite
# such a file, never another (a user's file given by mistake).
MARK = "user.hicache.l3"


def _marked(fd: int) -> bool:
    """Whether the file carries :data:`MARK` (False where the file system keeps no xattrs)."""
    try:
        os.getxattr(fd, MARK)
    except OSError:
        return False
    return True


def _mark(fd: int) -> None:
    with contextlib.suppress(OSError):  # no user xattrs here: overwritable again only while empty
        os.setxattr(fd, MARK, b"1")


def _resize(fd: int, size: int, what: str) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        if exc.errno == errno.EFBIG:  # RLIMIT_FSIZE or the file system's maximum file size
            raise ConfigError(f"{what}: a file of {size} bytes exceeds this process's file-size limit") from exc
        raise


class FileStore:
    """Slot-addressed pages in a :class:`StorageFile`; per-page checksums kept in memory."""

    kind = "file"
    keyed = False
    shared = False
    remote = False
    available = True

    def __init__(
        self,
        file: StorageFile,
        host: HostPool,
        *,
        chunk_pages: int = 8,
        checksums: bool = True,
        faults: FaultInjector | None = None,
    ) -> None:
        if file.geometry != host.geometry:
            raise ConfigError("L3 file and L2 pool have different geometries")
        if isinstance(chunk_pages, bool) or not isinstance(chunk_pages, int) or not 0 < chunk_pages <= IOV_MAX:
            raise ConfigError(f"storage chunk_pages must be an int in [1, {IOV_MAX}], got {chunk_pages!r}")
        self.file = file
        self.host = host
        self.slots = file.slots
        self.chunk_pages = chunk_pages
        self.checksums = checksums
        self.faults = faults or FaultInjector()
        self._pages = host.bytes.numpy()  # [pages, bytes_per_page] uint8, shares memory
        self._sums = np.zeros(file.slots, dtype=np.uint64)

    def plan(self, op: Op, host_pages: Sequence[int], slots: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
        """Chunks of at most ``chunk_pages`` consecutive slots; the count of file extents.
        Reads announce each extent (``WILLNEED``): parallel chunks on one file description
        would otherwise defeat the kernel's sequential readahead."""
        extents = runs(slots)
        step = self.chunk_pages
        chunks = [(c, min(end, c + step)) for first, end in extents for c in range(first, end, step)]
        if op == "read" and not self.file.direct:
            bpp = self.file.bytes_per_page
            for first, end in extents:
                os.posix_fadvise(self.file.fd, slots[first] * bpp, (end - first) * bpp, os.POSIX_FADV_WILLNEED)
        return chunks, len(extents)

    def put(self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None) -> list[PageStatus]:
        for first, end in runs(slots):
            hp = host_pages[first:end]
            sums = [xxhash.xxh3_64_intdigest(self._pages[p]) for p in hp] if self.checksums else None
            self._pwrite_all(self._iov(hp), self.file.offset(slots[first]))
            if sums is not None:
                self._sums[list(slots[first:end])] = sums
        return [PageStatus.OK] * len(slots)

    def get(self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None) -> list[PageStatus]:
        out = [PageStatus.OK] * len(slots)
        for first, end in runs(slots):
            self._pread_all(self._iov(host_pages[first:end]), self.file.offset(slots[first]))
        if self.checksums:
            for i, (p, s) in enumerate(zip(host_pages, slots, strict=True)):
                if xxhash.xxh3_64_intdigest(self._pages[p]) != int(self._sums[s]):
                    out[i] = PageStatus.CORRUPT
        return out

    def exists(self, keys: Sequence[bytes]) -> int:
        return 0

    def close(self) -> None:
        self.file.close()

    def status(self) -> dict[str, Any]:
        return {"path": self.file.path or "(unnamed)", "direct": self.file.direct, "checksums": self.checksums}

    # -- internals ---------------------------------------------------------------------------

    def _iov(self, host_pages: Sequence[int]) -> list[memoryview]:
        """Buffers for one file extent: one per run of consecutive host pages."""
        return [self._pages[host_pages[a] : host_pages[a] + (b - a)].data.cast("B") for a, b in runs(host_pages)]

    def _pwrite_all(self, iov: list[memoryview], offset: int) -> None:
        fault = self.faults.take("write", STORAGE_FAULTS)
        total = sum(len(v) for v in iov)
        done = 0
        while done < total:
            part = skip(iov, done)
            if fault is not None:
                part = _inject(self.faults, fault, part)
            n = os.pwritev(self.file.fd, part, offset + done) if part else 0
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite made no progress at byte {offset + done}")
            if fault is not None and fault.kind == "corrupt":
                first = skip(iov, done)[0]
                os.pwrite(self.file.fd, bytes([first[0] ^ 0xFF]), offset + done)
            fault = None
            done += n

    def _pread_all(self, iov: list[memoryview], offset: int) -> None:
        fault = self.faults.take("read", STORAGE_FAULTS)
        total = sum(len(v) for v in iov)
        done = 0
        while done < total:
            part = skip(iov, done)
            if fault is not None:
                part = _inject(self.faults, fault, part)
            n = os.preadv(self.file.fd, part, offset + done) if part else 0
            if n <= 0:
                raise OSError(errno.EIO, f"short read: end of data at byte {offset + done}")
            if fault is not None and fault.kind == "corrupt":
                first = skip(iov, done)[0]
                first[0] ^= 0xFF
            fault = None
            done += n


def _inject(faults: FaultInjector, fault: Fault, iov: list[memoryview]) -> list[memoryview]:
    kind = fault.kind
    if kind == "eio":
        raise OSError(errno.EIO, "injected EIO")
    if kind == "enospc":
        raise OSError(errno.ENOSPC, "injected ENOSPC")
    if kind == "slow":
        time.sleep(fault.delay_s)
    if kind == "hang":
        faults.hang(fault)
    if kind == "short":  # about half the bytes, kept 4 KiB aligned where the buffer allows
        want = sum(len(v) for v in iov) // 2
        want = max(1, want // ALIGN * ALIGN if want > ALIGN else want)
        out: list[memoryview] = []
        for v in iov:
            if want <= 0:
                break
            out.append(v[:want])
            want -= len(out[-1])
        return out
    if kind == "eof":
        return []
    return iov
