"""L3 storage: every failure gives a failed ticket or a clear error; the file is safe."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import torch

from hicache.backends.faults import FaultKind
from hicache.backends.pools import HostPool, coalesce
from hicache.backends.storage import StorageBackend, StorageFile
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError, PageOwnershipError
from tests.backends.store_helpers import a_forked_child_lives, close_in_a_child

G = KVGeometry(2, 2, 64, 16, torch.bfloat16)  # 8 KiB pages: O_DIRECT-sized


def backend(path: Path | None = None, *, slots: int = 8, direct: bool = False) -> StorageBackend:
    host = HostPool(G, 8)
    host.page_buffer.copy_(torch.randn(host.page_buffer.shape).to(G.dtype))
    return StorageBackend(StorageFile(G, slots, path, direct=direct), host)


def test_coalesce_needs_adjacency_on_both_sides() -> None:
    assert coalesce([0, 1, 2, 5], [3, 4, 5, 6]) == [(0, 3), (3, 4)]
    assert coalesce([0, 1, 2], [3, 5, 6]) == [(0, 1), (1, 3)]
    assert coalesce([], []) == []


def test_extents_are_counted() -> None:
    s = backend()
    t = s.write([0, 1, 2, 3], [4, 5, 6, 0])
    assert t.wait() and t.extents == 2 and s.status()["extents"] == 2
    s.close()


@pytest.mark.parametrize(
    ("kind", "op", "ok"),
    [
        ("eio", "write", False),
        ("enospc", "write", False),
        ("eof", "write", False),
        ("short", "write", True),  # a short write is looped to completion
        ("eio", "read", False),
        ("eof", "read", False),  # a short read at end of data fails
        ("short", "read", True),
        ("corrupt", "read", False),  # checksum mismatch
        ("corrupt", "write", False),  # the byte lands in the file; the read-back catches it
        ("slow", "read", True),
    ],
)
def test_fault_outcomes(kind: FaultKind, op: str, ok: bool) -> None:
    s = backend()
    want = s.host.page_buffer[0:2].clone()
    if op == "write":
        s.faults.add(kind, op="write", delay_s=0.01)
        written = s.write([0, 1], [3, 4]).wait()
        assert written == (ok or kind == "corrupt")
        result = s.read([3, 4], [5, 6]).wait() if written else False
    else:
        assert s.write([0, 1], [3, 4]).wait()
        s.faults.add(kind, op="read", delay_s=0.01)
        result = s.read([3, 4], [5, 6]).wait()
    assert result is ok
    if ok:
        assert torch.equal(s.host.page_buffer[5:7], want)
    assert s.faults.injected == {kind: 1}
    s.close()


def test_failed_ticket_reports_its_error() -> None:
    s = backend()
    s.faults.add("eio", op="write")
    t = s.write([0], [0])
    assert t.wait() is False and t.ok is False and t.error is not None and "EIO" in t.error
    s.close()


def test_bad_pages_raise_before_io() -> None:
    s = backend()
    for host_pages, slots in (([0], [8]), ([0, 0], [1, 2]), ([0], [1, 2]), ([9], [0])):
        with pytest.raises(PageOwnershipError):
            s.write(host_pages, slots)
    s.close()
    with pytest.raises(ConfigError, match="closed"):
        s.write([0], [0])


def test_unnamed_file_is_private_and_already_unlinked() -> None:
    f = StorageFile(G, 4)
    st = os.fstat(f.fd)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 0
    assert st.st_size == 4 * G.bytes_per_page
    f.close()


def test_named_file_is_truncated_and_0600(tmp_path: Path) -> None:
    """A file the store made before (or an empty one) is truncated to the store's size,
    mode 0600."""
    p = tmp_path / "l3.bin"
    StorageFile(G, 2, p).close()
    with p.open("r+b") as f:
        f.write(b"old contents" * 1000)
    p.chmod(0o644)
    f2 = StorageFile(G, 3, p)
    assert p.stat().st_size == 3 * G.bytes_per_page and stat.S_IMODE(p.stat().st_mode) == 0o600
    assert p.read_bytes()[:12] == bytes(12)
    f2.close()
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    StorageFile(G, 2, empty).close()
    assert empty.stat().st_size == 2 * G.bytes_per_page


def test_a_users_file_is_refused_and_left_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An existing non-empty file the store did not make (no mark) is refused, its bytes
    and mode unchanged; where the file system keeps no extended attributes, a non-empty file
    is refused even if a store made it (nothing tells them apart)."""
    mine = tmp_path / "notes.txt"
    mine.write_bytes(b"precious" * 100)
    mine.chmod(0o644)
    with pytest.raises(ConfigError, match="hicache did not make"):
        StorageFile(G, 2, mine)
    assert mine.read_bytes() == b"precious" * 100 and stat.S_IMODE(mine.stat().st_mode) == 0o644
    ours = tmp_path / "l3.bin"
    StorageFile(G, 2, ours).close()

    def no_xattrs(*args: object) -> None:
        raise OSError(errno.ENOTSUP, "Operation not supported")

    monkeypatch.setattr(os, "getxattr", no_xattrs)
    monkeypatch.setattr(os, "setxattr", no_xattrs)
    with pytest.raises(ConfigError, match="hicache did not make"):
        StorageFile(G, 2, ours)
    assert ours.stat().st_size == 2 * G.bytes_per_page
    fresh = tmp_path / "fresh.bin"
    StorageFile(G, 2, fresh).close()  # a new file needs no mark


def test_refuses_directory_symlink_foreign_owner_and_no_room(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="directory"):
        StorageFile(G, 2, tmp_path)
    target = tmp_path / "real"
    target.write_bytes(b"")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        StorageFile(G, 2, link)
    with pytest.raises(ConfigError, match="does not exist"):
        StorageFile(G, 2, tmp_path / "missing" / "l3.bin")
    with pytest.raises(ConfigError, match=f"directory {target} is not a directory"):  # a file: not "does not exist"
        StorageFile(G, 2, target / "l3.bin")
    with pytest.raises(ConfigError, match="File name too long"):
        StorageFile(G, 2, tmp_path / ("n" * 300))
    with pytest.raises(ConfigError, match="free"):
        StorageFile(G, 2**40, tmp_path / "huge.bin")
    if os.geteuid() == 0:
        other = tmp_path / "other"
        other.write_bytes(b"")
        os.chown(other, 12345, 12345)
        with pytest.raises(ConfigError, match="owned by uid 12345"):
            StorageFile(G, 2, other)


def test_refuses_unwritable_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() == 0:  # root may write anywhere; emulate a read-only directory
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    else:
        tmp_path.chmod(0o500)
    with pytest.raises(ConfigError, match="not writable"):
        StorageFile(G, 2, tmp_path / "l3.bin")


def test_symlink_planted_after_validation_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / "l3.bin"
    real_validate = StorageFile._validate

    def racing_validate(self: StorageFile, p: Path) -> None:
        real_validate(self, p)
        path.symlink_to(victim)  # an attacker swaps in a symlink between check and open

    monkeypatch.setattr(StorageFile, "_validate", racing_validate)
    with pytest.raises(ConfigError, match="symlink"):
        StorageFile(G, 2, path)
    assert victim.read_bytes() == b"precious"


def test_refused_o_direct_falls_back_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that refuses O_DIRECT (EINVAL at open, as older tmpfs does) gets
    buffered I/O and a warning, and still round-trips."""
    import errno

    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    for path in (tmp_path / "named.bin", None):
        with pytest.warns(RuntimeWarning, match="O_DIRECT"):
            s = backend(path, direct=True)
        assert not s.file.direct
        assert s.write([0], [0]).wait() and s.read([0], [1]).wait()
        assert torch.equal(s.host.page_buffer[0], s.host.page_buffer[1])
        s.close()


def test_o_direct_round_trip_where_supported(tmp_path: Path) -> None:
    import warnings

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        s = backend(tmp_path / "direct.bin", direct=True)
    want = s.host.page_buffer[2:4].clone()
    assert s.write([2, 3], [5, 6]).wait() and s.read([5, 6], [0, 1]).wait()
    assert torch.equal(s.host.page_buffer[0:2], want)
    s.close()


def test_close_cancels_queued_work_without_success() -> None:
    s = backend()
    s.faults.add("slow", 3, delay_s=0.05)
    tickets = [s.write([i], [i]) for i in range(6)]
    s.close(wait=False)
    outcomes = [t.wait() for t in tickets]
    assert all(isinstance(o, bool) for o in outcomes)
    assert not all(outcomes) or s.closed


def test_chunked_requests_fail_whole_if_one_chunk_fails() -> None:
    """A request split into parallel chunks fails if any chunk fails, and succeeds bit-exact
    otherwise."""
    host = HostPool(G, 8)
    host.page_buffer.copy_(torch.randn(host.page_buffer.shape).to(G.dtype))
    s = StorageBackend(StorageFile(G, 8), host, chunk_pages=2)
    want = host.page_buffer[0:6].clone()
    assert s.write(list(range(6)), list(range(6))).wait()
    s.faults.add("corrupt", op="read")
    assert s.read(list(range(6)), [2, 3, 4, 5, 6, 7]).wait() is False
    assert s.read(list(range(6)), [2, 3, 4, 5, 6, 7]).wait()
    assert torch.equal(host.page_buffer[2:8], want)
    s.close()


def test_recurring_time_excludes_poll_lag() -> None:
    """The cost model learns the work's own time: enqueue (less setup) + queue + service +
    completion. Time a ticket sat finished before anyone polled it is not part of it."""
    import time

    s = backend()
    t = s.write([0, 1], [0, 1])
    time.sleep(0.05)  # the work may finish meanwhile; nobody looks for 50 ms
    assert t.wait() and t.finished_at is not None
    assert t.finished_at <= t.started + t.timings.total_s
    tm = t.timings
    assert tm.recurring_s == pytest.approx(
        max(0.0, tm.enqueue_s - tm.setup_s) + tm.queue_s + tm.service_s + tm.complete_s
    )
    assert tm.total_s >= tm.recurring_s
    s.close()


def test_second_cache_on_a_named_file_is_refused_and_the_first_keeps_its_pages(tmp_path: Path) -> None:
    """Two caches on one ``storage_path``: the second gets ConfigError and does not
    truncate the live file of the first."""
    path = tmp_path / "l3.bin"
    s = backend(path)
    want = s.host.page_buffer[0].clone()
    assert s.write([0], [3]).wait()
    with pytest.raises(ConfigError, match="in use by another cache"):
        StorageFile(G, 8, path)
    assert path.stat().st_size == 8 * G.bytes_per_page
    assert s.read([3], [1]).wait() and torch.equal(s.host.page_buffer[1], want)
    s.close()
    StorageFile(G, 8, path).close()  # free again once the first closed


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_close_lets_go_of_the_file_while_a_forked_child_lives(tmp_path: Path) -> None:
    """A child forked while the file is open (a worker pool's) shares its flock: ``close()``
    unlocks it, so the path opens again at once; a child closing its copy does not unlock
    the parent's."""
    path = tmp_path / "l3.bin"
    f = StorageFile(G, 8, path)
    with a_forked_child_lives():
        f.close()
        StorageFile(G, 8, path).close()  # in use by nobody now
    f = StorageFile(G, 8, path)
    close_in_a_child(f.close)  # a child of an open file closing its copy: the parent's lock stays
    with pytest.raises(ConfigError, match="in use by another cache"):
        StorageFile(G, 8, path)
    f.close()


def test_file_size_limit_below_l3_is_a_config_error_and_leaves_no_file(tmp_path: Path) -> None:
    """EFBIG (RLIMIT_FSIZE below the L3 size) is a ConfigError; no empty file is left."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    path = tmp_path / "l3.bin"
    resource.setrlimit(resource.RLIMIT_FSIZE, (G.bytes_per_page, hard))
    try:
        with pytest.raises(ConfigError, match="file-size limit"):
            StorageFile(G, 4, path)
        with pytest.raises(ConfigError, match="file-size limit"):
            StorageFile(G, 4)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not path.exists()


def test_permission_denied_on_the_way_in_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:  # root enters anything: emulate the kernel's answer
        monkeypatch.setattr(Path, "is_symlink", lambda self: (_ for _ in ()).throw(PermissionError(13, "denied")))
    else:
        locked.chmod(0)
    with pytest.raises(ConfigError, match="permission denied"):
        StorageFile(G, 2, locked / "l3.bin")


def test_a_cache_that_loses_the_race_for_a_new_path_leaves_the_winners_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another cache makes and locks the file between this one's checks and its open: this
    one is refused, and the winner's live file stays at its path (removed, the lock would
    keep no third cache out)."""
    path = tmp_path / "l3.bin"
    real_open = os.open
    winner: list[StorageFile] = []
    raced = [False]

    def racing(name: object, flags: int, *args: object) -> int:
        if not raced[0] and Path(str(name)) == path:
            raced[0] = True
            winner.append(StorageFile(G, 8, path))  # made and locked in between
        return real_open(name, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", racing)
    with pytest.raises(ConfigError, match="in use by another cache"):
        StorageFile(G, 8, path)
    monkeypatch.setattr(os, "open", real_open)
    assert path.exists() and path.stat().st_ino == os.fstat(winner[0].fd).st_ino
    with pytest.raises(ConfigError, match="in use by another cache"):
        StorageFile(G, 8, path)  # the lock still keeps a third one out
    winner[0].close()
    StorageFile(G, 8, path).close()


def test_a_file_removed_and_made_again_before_the_lock_is_not_the_one_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path is removed and made anew between this cache's open and its lock (another
    process's start and end): the store opens again and uses the file that the path names,
    not a file no one can find (a second cache would make its own beside it)."""
    import fcntl

    path = tmp_path / "l3.bin"
    real_flock = fcntl.flock
    swapped = [False]

    def swap_then_lock(fd: int, op: int) -> None:
        if not swapped[0]:
            swapped[0] = True
            path.unlink()
            path.write_bytes(b"")
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", swap_then_lock)
    f = StorageFile(G, 8, path)
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert swapped[0] and os.fstat(f.fd).st_ino == path.stat().st_ino
    with pytest.raises(ConfigError, match="in use by another cache"):
        StorageFile(G, 8, path)
    f.close()


def _xattrs_here(where: Path) -> bool:
    probe = where / "xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.hicache.probe", b"1")
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


def test_a_cache_killed_while_it_sizes_a_new_file_leaves_one_a_later_cache_opens(tmp_path: Path) -> None:
    """A process killed after the new file was sized (SIGKILL, the OOM killer) left a file of
    full size: it carries the store's mark already, so the next cache opens it instead of
    refusing it as a file hicache did not make."""
    import subprocess
    import sys

    if not _xattrs_here(tmp_path):
        pytest.skip("this file system keeps no user extended attributes (nothing marks a file)")
    path = tmp_path / "l3.bin"
    code = (
        "import os, sys, torch\n"
        "from hicache.backends.storage import StorageFile\n"
        "from hicache.core.geometry import KVGeometry\n"
        "os.fchmod = lambda fd, mode: os._exit(9)  # killed once the file is sized\n"
        "StorageFile(KVGeometry(2, 2, 64, 16, torch.bfloat16), 8, sys.argv[1])\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 9, run.stderr[-2000:]
    assert path.stat().st_size == 8 * G.bytes_per_page  # sized, never finished
    StorageFile(G, 8, path).close()


def test_a_new_file_that_cannot_be_locked_is_removed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``flock`` failing for want of locks (ENOLCK: NFS without lockd) is a ConfigError, and
    the file this cache created is removed (no one could hold it)."""
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    path = tmp_path / "l3.bin"
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(ConfigError, match="No locks available"):
        StorageFile(G, 8, path)
    assert not path.exists()
