"""The ``dir`` store: a persistent local L3 that survives restarts, one file per page.

    <dir>/LOCK                   the pid of the one process using the directory (which flocks
                                 the directory itself and this file)
    <dir>/FORMAT                 page size in bytes and format version; a mismatch is refused
    <dir>/<32 hex>.page          payload (bytes_per_page) + a 64-byte trailer
    <dir>/.tmp-<32 hex>-<pid>-n  being written; deleted at open

Why a file per page rather than an append log: pages are large (megabytes), so a file each
costs little; a page becomes visible atomically by ``rename`` after its bytes are durable
(write, ``fdatasync``, rename, ``fsync`` of the directory); LRU eviction is one ``unlink``
with no compaction; and a crash can leave only ``.tmp-`` files, which never have a page's
name. The trailer holds the magic, format version, payload length, the key and the payload's
xxh3-128, and its own checksum.

Verification: on open, every page's size and trailer (key = file name, checksums of the
trailer) are checked and anything wrong is deleted; on every read, the payload's checksum
too: a torn or corrupt page is never served (it is deleted and reported CORRUPT). The
directory is 0700, files 0600, nothing is opened through a symlink (``O_NOFOLLOW``, all
paths relative to the directory's descriptor) and no open waits on a FIFO planted under a
page's name (``O_NONBLOCK``; what is not a regular file is dropped, a directory left where it
is with a warning). At most ``capacity`` pages: the least
recently used (by read or write; kept across restarts as file mtimes) are evicted. A page is
reachable only through the pages before it in its prompt (a read stops at the first missing
key), so after a whole read or write the mover calls :meth:`DirStore.order`: within those
pages the first counts as the most recent, and eviction takes a prompt's pages from its end,
as the tree evicts leaves first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from hicache.backends.faults import FaultInjector, FaultKind
from hicache.backends.pools import HostPool
from hicache.backends.stores import forks
from hicache.backends.stores.base import Op, PageStatus
from hicache.backends.stores.iov import read_all, write_all
from hicache.core.keys import KEY_BYTES
from hicache.errors import ConfigError, MisuseError

log = logging.getLogger(__name__)
DIR_FAULTS: tuple[FaultKind, ...] = ("eio", "enospc", "corrupt", "slow", "hang")
MAGIC = b"HICPAGE\x01"
VERSION = 1
_TRAILER = struct.Struct("<8sIIQ16s16s")  # magic, version, flags, payload bytes, key, payload xxh3-128
TRAILER_BYTES = _TRAILER.size + 8  # + xxh3-64 of the fields above
SUFFIX = ".page"
_NAME_LEN = 2 * KEY_BYTES + len(SUFFIX)


def _trailer(key: bytes, payload_sum: bytes, nbytes: int) -> bytes:
    head = _TRAILER.pack(MAGIC, VERSION, 0, nbytes, key, payload_sum)
    return head + xxhash.xxh3_64_digest(head)


def _parse_trailer(raw: bytes, nbytes: int) -> tuple[bytes, bytes] | None:
    """``(key, payload checksum)``, or None if the trailer is not a valid one for ``nbytes``."""
    if len(raw) != TRAILER_BYTES or xxhash.xxh3_64_digest(raw[: _TRAILER.size]) != raw[_TRAILER.size :]:
        return None
    magic, version, _, length, key, payload_sum = _TRAILER.unpack(raw[: _TRAILER.size])
    if magic != MAGIC or version != VERSION or length != nbytes:
        return None
    return key, payload_sum


class DirStore:
    """Keyed pages in a directory (see the module docstring)."""

    kind = "dir"
    keyed = True
    shared = True  # pages written by an earlier process appear at open
    remote = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        host: HostPool,
        *,
        capacity: int,
        chunk_pages: int = 8,
        fsync: bool = True,
        faults: FaultInjector | None = None,
    ) -> None:
        self.path = Path(path)
        self.host = host
        self.capacity = capacity
        self.chunk_pages = chunk_pages
        self.fsync = fsync
        self.faults = faults or FaultInjector()
        self.bytes_per_page = host.geometry.bytes_per_page
        self._pages = host.bytes.numpy()
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._writing = 0  # pages reserved by puts in flight
        self._tmp = itertools.count()
        self.counts = {"evicted": 0, "dropped_corrupt": 0, "dropped_at_open": 0, "temp_removed_at_open": 0}
        try:
            made = not self.path.exists()
        except OSError as exc:  # NOTE: a name longer than the system takes
            raise ConfigError(f"L3 directory {self.path}: {exc.strerror or exc}") from exc
        self._made_format = False  # this opener wrote FORMAT (so the store is new, and its own)
        self.dirfd = _open_dir(self.path)
        self.lockfd = -1
        self._locked_by = -1  # the process that holds the lock (close unlocks there only)
        before: set[str] = set()
        try:
            before = _check_adoptable(self.dirfd, self.path)  # before the lock file is made in it
            self.lockfd = _lock_dir(self.dirfd, self.path)
            self._locked_by = os.getpid()
            forks.drop_in_children(self)
            if "FORMAT" not in before:
                self._check_room()  # NOTE: a new store: refused for room before any file is made
            self._check_format()
            self._scan()
            self._check_room()
        except BaseException as exc:
            if self.lockfd >= 0:
                self._undo(made, before)  # a refused store leaves the directory as it was
            self.close()
            if isinstance(exc, OSError):
                raise ConfigError(f"L3 directory {self.path}: cannot set up its files ({exc.strerror or exc})") from exc
            raise

    # -- opening -------------------------------------------------------------------------------

    def _check_format(self) -> None:
        want = f"hicache-dir-store {VERSION}\nbytes_per_page {self.bytes_per_page}\n"
        try:
            fd = os.open("FORMAT", os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dirfd)
        except FileNotFoundError:
            if "FORMAT.tmp" in _check_adoptable(self.dirfd, self.path):  # again, under the lock
                os.unlink("FORMAT.tmp", dir_fd=self.dirfd)  # a dead opener's: made anew, not written through
            # NOTE: first: a signal's exception between the create and this would leave the
            # temp file behind (under the lock, no one else makes it)
            self._made_format = True
            fd = os.open("FORMAT.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self.dirfd)  # fmt: skip
            try:
                os.write(fd, want.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename("FORMAT.tmp", "FORMAT", src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)
            os.fsync(self.dirfd)
            return
        try:
            raw = os.read(fd, 4096)
        except IsADirectoryError:
            raise ConfigError(
                f"L3 directory {self.path}: its FORMAT is a directory, not a hicache store's format file; "
                "give another directory"
            ) from None
        finally:
            os.close(fd)
        have = raw.decode(errors="replace")
        text = have.isascii() and have.replace("\n", "").isprintable()  # our format's lines, as we write them
        if have != want and not (text and have.startswith("hicache-dir-store ")):
            # NOTE: say what it is, not what it holds: a damaged or foreign file's bytes are noise
            raise ConfigError(
                f"L3 directory {self.path}: its FORMAT file is not a hicache store's ({len(raw)}"
                f"{'+' if len(raw) == 4096 else ''} bytes{'' if text else ', not text'}); give another directory"
            )
        if have != want:
            said = "; ".join(have.split("\n")).strip("; ")[:200]  # one line, whatever the file holds
            need = "; ".join(want.split("\n")).strip("; ")
            raise ConfigError(
                f"L3 directory {self.path} holds pages of another layout ({said!r}, we need {need!r}); "
                "give another directory"
            )

    def _scan(self) -> None:
        """Index the pages a previous process left; delete temp files and anything broken."""
        found: list[tuple[int, bytes]] = []
        uid = os.geteuid()
        with os.scandir(self.dirfd) as it:
            for entry in it:
                name = entry.name
                if name.startswith(".tmp-"):
                    self._unlink(name)
                    self.counts["temp_removed_at_open"] += 1
                    continue
                if not name.endswith(SUFFIX):
                    continue
                st = entry.stat(follow_symlinks=False)
                key = _key_of(name)
                if (
                    key is None
                    or not stat.S_ISREG(st.st_mode)
                    or st.st_uid != uid
                    or st.st_size != self.bytes_per_page + TRAILER_BYTES
                    or self._read_trailer(name) != key
                ):
                    self._unlink(name)
                    self.counts["dropped_at_open"] += 1
                    continue
                found.append((st.st_mtime_ns, key))
        found.sort()
        for _, key in found:
            self._lru[key] = None
        over = len(self._lru) - self.capacity
        if over > 0:
            # NOTE: a store reopened smaller keeps its most recent pages; the user hears of the rest.
            log.warning(
                "L3 directory %s holds %d pages, more than its capacity of %d: deleting the %d least recently used",
                self.path, len(self._lru), self.capacity, over,
            )  # fmt: skip
        while len(self._lru) > self.capacity:
            self._evict_one()

    def _read_trailer(self, name: str) -> bytes | None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dirfd)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):  # NOTE: the process's limits, not
                raise  # the page's fault: the open fails rather than delete good pages
            return None
        try:
            parsed = _parse_trailer(os.pread(fd, TRAILER_BYTES, self.bytes_per_page), self.bytes_per_page)
        finally:
            os.close(fd)
        return None if parsed is None else parsed[0]

    def _undo(self, made: bool, before: set[str]) -> None:
        """Remove what a refused open made (a new store's FORMAT, the lock file, the directory
        itself), best effort, while its lock is still held. Only what this opener made: the
        listing ``before`` was taken before the lock, so another process may have created
        the store since (its FORMAT and lock file stay)."""
        if "FORMAT" in before:  # NOTE: a store, or a stranger's FORMAT: only the lock file was ours
            if "LOCK" not in before:
                with contextlib.suppress(OSError):
                    os.unlink("LOCK", dir_fd=self.dirfd)
            return
        try:
            os.stat("FORMAT", dir_fd=self.dirfd, follow_symlinks=False)
            theirs = not self._made_format
        except OSError:
            theirs = False
        names = ("FORMAT.tmp", "FORMAT") if self._made_format else ()
        for name in (*names, *(() if "LOCK" in before or theirs else ("LOCK",))):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.dirfd)
        if made:
            with contextlib.suppress(OSError):
                self.path.rmdir()  # only if empty

    def _check_room(self) -> None:
        vfs = os.statvfs(self.dirfd)
        need = (self.capacity - len(self._lru)) * (self.bytes_per_page + TRAILER_BYTES)
        free = vfs.f_bavail * vfs.f_frsize
        if free < need:
            raise ConfigError(
                f"L3 directory {self.path}: needs {need} more bytes, only {free} free on that file system"
            )

    # -- the PageStore face ----------------------------------------------------------------------

    def plan(self, op: Op, host_pages: Sequence[int], slots: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
        n = len(slots)
        return [(a, min(n, a + self.chunk_pages)) for a in range(0, n, self.chunk_pages)], n

    def exists(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._lru:
                    return i
        return len(keys)

    def put(self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None) -> list[PageStatus]:
        if keys is None:
            raise MisuseError("the dir store addresses pages by key; give keys")
        out = [PageStatus.EXISTS] * len(keys)
        todo: list[int] = []
        kept: set[bytes] = set()
        with self._lock:
            for i, key in enumerate(keys):
                if key in self._lru:
                    self._lru.move_to_end(key)
                    kept.add(key)
                else:
                    todo.append(i)
            room = self.capacity - len(self._lru) - self._writing
            # NOTE: the pages answered EXISTS are the most recent now: eviction stops short of
            # them (evicting one would report a page stored that is gone)
            while room < len(todo) and len(self._lru) > len(kept):
                self._evict_one()
                room += 1
            for i in todo[max(0, room) :]:
                out[i] = PageStatus.FULL
            todo = todo[: max(0, room)]
            self._writing += len(todo)
        written: list[tuple[int, str]] = []
        try:
            for i in todo:
                tmp = self._write_temp(host_pages[i], keys[i])
                if tmp is None:
                    out[i] = PageStatus.FAILED
                else:
                    written.append((i, tmp))
            named: list[tuple[int, str]] = []
            for i, tmp in written:  # NOTE: only durable bytes get a page's name
                try:
                    os.rename(tmp, _name(keys[i]), src_dir_fd=self.dirfd, dst_dir_fd=self.dirfd)
                except IsADirectoryError:  # NOTE: someone's directory has the name: this page alone fails
                    self._unlink(tmp)
                    out[i] = PageStatus.FAILED
                    continue
                named.append((i, tmp))
            written = named
            if written and self.fsync:
                os.fsync(self.dirfd)
        except BaseException:
            for _, tmp in written:
                self._unlink(tmp)
            raise
        finally:
            with self._lock:
                self._writing -= len(todo)
        with self._lock:
            for i, _ in written:
                self._lru[keys[i]] = None
                self._lru.move_to_end(keys[i])
                out[i] = PageStatus.OK
        return out

    def order(self, keys: Sequence[bytes]) -> None:
        """``keys`` (one prompt's pages, in order, just read or written) become the most
        recently used, ``keys[0]`` the most recent of them: eviction takes them last-first.
        In memory only; :meth:`stamp` keeps the order for the next open."""
        with self._lock:
            for key in reversed(keys):
                if key in self._lru:
                    self._lru.move_to_end(key)

    def stamp(self, keys: Sequence[bytes]) -> None:
        """The order of :meth:`order` as file mtimes (``keys[0]`` the newest, 1 µs apart),
        which a later open sorts by. Best effort: a page gone since is skipped."""
        now = time.time_ns()
        for i, key in enumerate(keys):
            t = now - 1000 * i
            with contextlib.suppress(OSError):
                os.utime(_name(key), ns=(t, t), dir_fd=self.dirfd, follow_symlinks=False)

    def get(self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None) -> list[PageStatus]:
        if keys is None:
            raise MisuseError("the dir store addresses pages by key; give keys")
        return [self._read_page(p, k) for p, k in zip(host_pages, keys, strict=True)]

    def close(self) -> None:
        if self.lockfd >= 0 and os.getpid() == self._locked_by:
            # NOTE: unlocked, not only closed: a child forked meanwhile shares the locked files,
            # and closing our descriptors leaves the lock held while it lives. Only the process
            # that locked them unlocks: a child closing its copies must not unlock ours.
            for fd in (self.lockfd, self.dirfd):
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
        fds = (self.lockfd, self.dirfd)
        self.lockfd = self.dirfd = -1  # NOTE: first: a child forked meanwhile must not close reused numbers
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def drop_in_child(self) -> None:
        """In a forked child: close the copies of the locked descriptors (the parent keeps the
        lock; a child outliving a killed parent must not)."""
        for fd in (self.lockfd, self.dirfd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.lockfd = self.dirfd = -1

    @property
    def available(self) -> bool:
        """False once the directory was removed under us (``rm -r`` of the store): its pages
        are gone and nothing can be written, so the cache serves on without L3."""
        if self.dirfd < 0:
            return False
        try:
            return os.fstat(self.dirfd).st_nlink > 0
        except OSError:
            return False

    def status(self) -> dict[str, Any]:
        with self._lock:
            pages = len(self._lru)
        st = {"path": str(self.path), "pages": pages, "capacity": self.capacity, "fsync": self.fsync, **self.counts}
        if self.dirfd >= 0 and not self.available:
            st["error"] = f"L3 directory {self.path} was removed"
        return st

    # -- internals ---------------------------------------------------------------------------------

    def _write_temp(self, page: int, key: bytes) -> str | None:
        """Write one page (payload + trailer) to a new temp file and make it durable; its
        name, or None after an error (the temp file removed)."""
        fault = self.faults.take("write", DIR_FAULTS)
        tmp = f".tmp-{key.hex()}-{os.getpid()}-{next(self._tmp)}"
        payload = self._pages[page]
        trailer = _trailer(key, xxhash.xxh3_128_digest(payload), self.bytes_per_page)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.dirfd)
        try:
            if fault is not None:
                _inject(self.faults, fault)
            write_all(fd, [payload.data.cast("B"), memoryview(trailer)])
            if fault is not None and fault.kind == "corrupt":  # the bytes on disk differ from the checksum
                os.pwrite(fd, bytes([int(payload[0]) ^ 0xFF]), 0)
            if self.fsync:
                os.fdatasync(fd)
        except OSError as exc:
            log.warning("hicache L3 dir: writing page %s failed: %s", key.hex(), exc)
            os.close(fd)
            self._unlink(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
                return None
            raise
        os.close(fd)
        return tmp

    def _read_page(self, page: int, key: bytes) -> PageStatus:
        name = _name(key)
        fault = self.faults.take("read", DIR_FAULTS)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dirfd)
        except FileNotFoundError:
            with self._lock:
                self._lru.pop(key, None)
            return PageStatus.MISSING
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EISDIR, errno.ELOOP):
                raise
            # NOTE: what is under the name cannot be read, and would not be by the next read
            # either: forgotten (a write may replace it), so the prompt recomputes once, not
            # at every admission.
            log.warning("hicache L3 dir: page %s cannot be opened (%s); forgotten", key.hex(), exc.strerror)
            with self._lock:
                self._lru.pop(key, None)
            return PageStatus.MISSING
        try:
            if fault is not None:
                _inject(self.faults, fault)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != self.bytes_per_page + TRAILER_BYTES:
                return self._drop(key, "wrong size")
            view = self._pages[page].data.cast("B")
            trailer = bytearray(TRAILER_BYTES)
            read_all(fd, [view, memoryview(trailer)])
            if fault is not None and fault.kind == "corrupt":
                view[0] ^= 0xFF
            parsed = _parse_trailer(bytes(trailer), self.bytes_per_page)
            if parsed is None or parsed[0] != key:
                return self._drop(key, "bad trailer")
            if xxhash.xxh3_128_digest(view) != parsed[1]:
                return self._drop(key, "payload checksum mismatch")
        finally:
            os.close(fd)
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
        return PageStatus.OK  # NOTE: its mtime (recency at the next open) is set by stamp()

    def _drop(self, key: bytes, why: str) -> PageStatus:
        log.warning("hicache L3 dir: page %s is corrupt (%s); deleted, never served", key.hex(), why)
        with self._lock:
            self._lru.pop(key, None)
            self.counts["dropped_corrupt"] += 1
        self._unlink(_name(key))
        return PageStatus.CORRUPT

    def _evict_one(self) -> None:
        """Under the lock: delete the least recently used page."""
        key, _ = self._lru.popitem(last=False)
        self.counts["evicted"] += 1
        self._unlink(_name(key))

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.dirfd)
        except FileNotFoundError:
            pass
        except (IsADirectoryError, PermissionError) as exc:  # NOTE: a directory (EISDIR, or EPERM elsewhere)
            # Someone else's: left where it is, never read (not a regular file); a page
            # written under its name fails.
            log.warning("L3 directory %s: cannot remove %s (%s); remove it by hand", self.path, name, exc.strerror)


def _name(key: bytes) -> str:
    return key.hex() + SUFFIX


def _key_of(name: str) -> bytes | None:
    """The key a page file's name holds: exactly the name :func:`_name` gives it (lower-case
    hex), or None (upper case would be indexed under a name no read opens)."""
    if len(name) != _NAME_LEN:
        return None
    try:
        key = bytes.fromhex(name[: 2 * KEY_BYTES])
    except ValueError:
        return None
    return key if _name(key) == name else None


def _open_dir(path: Path) -> int:
    """Create (0700) or check the directory and open it without following a symlink. An
    existing directory keeps its mode (pages are files of mode 0600) unless others may
    write into it: then it is refused (they could plant pages)."""
    try:
        if path.is_symlink():
            raise ConfigError(f"L3 directory {path} is a symlink; give the real path")
        if not path.exists():
            if not path.parent.is_dir():
                what = "is not a directory" if path.parent.exists() else "does not exist"
                raise ConfigError(f"L3 directory {path}: parent {path.parent} {what}")
            if os.statvfs(path.parent).f_blocks == 0:  # NOTE: mkdir there fails with a bare ENOENT
                raise ConfigError(
                    f"L3 directory {path}: on a file system that stores no data (such as /proc); give a disk path"
                )
            with contextlib.suppress(FileExistsError):  # another opener made it first: checked as theirs below
                path.mkdir(mode=0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except PermissionError as exc:
        raise ConfigError(f"L3 directory {path}: permission denied ({exc.strerror})") from exc
    except NotADirectoryError as exc:
        raise ConfigError(f"L3 directory {path} is not a directory") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"L3 directory {path} became a symlink; refusing to follow it") from exc
        raise ConfigError(f"L3 directory {path}: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise ConfigError(f"L3 directory {path} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(
                f"L3 directory {path} has mode {stat.S_IMODE(st.st_mode):o}: others may write there and plant "
                "pages; give a directory only you can write (chmod go-w), or a new path"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"L3 directory {path} is not writable")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_adoptable(dirfd: int, path: Path) -> set[str]:
    """A directory without a store (no FORMAT file) must hold nothing but a lock file:
    opening a store scans it and deletes what looks like a broken page or temp file, so it
    never adopts a user's directory. Returns the names it holds.

    A regular file ``FORMAT.tmp`` beside a ``LOCK`` (an opener makes the lock file first) is
    a store being made: by another opener (it holds the lock: ours is refused as in use,
    not as a stranger's directory) or by one that died before its rename (under the lock it
    is unlinked and the store made anew: never written through, it may be a link)."""
    names = set(os.listdir(dirfd))
    ours = {"LOCK"}
    if "LOCK" in names and "FORMAT.tmp" in names:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.stat("FORMAT.tmp", dir_fd=dirfd, follow_symlinks=False).st_mode):
                ours.add("FORMAT.tmp")
    foreign = sorted(names - ours)
    if "FORMAT" not in names and foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ConfigError(
            f"L3 directory {path} is not empty and holds no hicache store (no FORMAT file; it has {shown}); "
            "give an empty or new directory"
        )
    return names


def _lock_dir(dirfd: int, path: Path) -> int:
    """Lock the directory for this opener: ``flock`` on the directory itself (a cleanup that
    deletes ``LOCK`` cannot undo it) and on ``LOCK``, which names the holder's pid."""
    fd = os.open("LOCK", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dirfd)
    try:
        try:
            fcntl.flock(dirfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").partition("\n")[0].strip()
            if not holder:  # NOTE: its LOCK file was removed and made anew, or the holder is writing it
                who = "another process (its pid is not in the LOCK file)"
            elif holder == str(os.getpid()):
                who = "another cache of this process"
            else:
                who = f"another process (pid {holder})"
            raise ConfigError(f"L3 directory {path} is in use by {who}; give each its own") from exc
        # NOTE: the pid first, then the old tail cut: a refused opener reading meanwhile sees a
        # whole first line (an emptied file would read as a removed one)
        line = f"{os.getpid()}\n".encode()
        os.pwrite(fd, line, 0)
        os.ftruncate(fd, len(line))
    except BaseException:  # NOTE: a signal's exception too: the caller never sees fd, so its lock
        os.close(fd)
        raise
    return fd


def _inject(faults: FaultInjector, fault: Any) -> None:
    if fault.kind == "eio":
        raise OSError(errno.EIO, "injected EIO")
    if fault.kind == "enospc":
        raise OSError(errno.ENOSPC, "injected ENOSPC")
    if fault.kind == "slow":
        time.sleep(fault.delay_s)
    if fault.kind == "hang":
        faults.hang(fault)
