"""The ``dir`` store: bit-exact, persistent across restarts, crash-safe, locked, bounded."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hicache.backends.stores.dir as dirmod
from hicache.backends.pools import HostPool
from hicache.backends.storage import StorageFile
from hicache.backends.stores import PageStatus, open_storage
from hicache.backends.stores.dir import TRAILER_BYTES
from hicache.core.geometry import KVGeometry
from hicache.errors import ConfigError
from tests.backends.store_helpers import (
    KEYS,
    G,
    a_forked_child_lives,
    close_in_a_child,
    dir_store,
    eventually,
    fill,
    page_bytes,
)


def page_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.page"))


def test_round_trip_is_bit_exact_and_files_are_private(tmp_path: Path) -> None:
    """Pages written from scattered L2 pages read back bit-exactly into other L2 pages;
    the directory is 0700 and every page file 0600."""
    s = dir_store(tmp_path / "l3")
    fill(s.host, [5, 1, 3], [0, 1, 2])
    assert s.write([5, 1, 3], [0, 1, 2], KEYS[:3]).wait()
    assert s.read([0, 1, 2], [0, 2, 4], KEYS[:3]).wait()
    for p, i in zip([0, 2, 4], range(3), strict=True):
        assert torch.equal(s.host.bytes[p], page_bytes(i))
    assert stat.S_IMODE((tmp_path / "l3").stat().st_mode) == 0o700
    files = page_files(tmp_path / "l3")
    assert len(files) == 3 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    s.close()


def test_pages_survive_a_restart(tmp_path: Path) -> None:
    """A new process (a new store on the same directory) finds and serves the pages."""
    s = dir_store(tmp_path)
    fill(s.host, list(range(4)), list(range(4)))
    assert s.write(list(range(4)), list(range(4)), KEYS[:4]).wait()
    s.close()
    s2 = dir_store(tmp_path)
    assert s2.exists(KEYS[:6]) == 4
    assert s2.read(list(range(4)), [7, 6, 5, 4], KEYS[:4]).wait()
    for p, i in zip([7, 6, 5, 4], range(4), strict=True):
        assert torch.equal(s2.host.bytes[p], page_bytes(i))
    s2.close()


def test_exists_counts_leading_keys_only(tmp_path: Path) -> None:
    s = dir_store(tmp_path)
    fill(s.host, [0, 1], [0, 2])
    assert s.write([0, 1], [0, 2], [KEYS[0], KEYS[2]]).wait()
    assert s.exists(KEYS[:3]) == 1  # KEYS[1] missing: KEYS[2] does not count
    assert s.exists(KEYS[1:3]) == 0
    s.close()


def test_pages_already_stored_are_not_written_again(tmp_path: Path) -> None:
    """A second write of stored keys succeeds as EXISTS and leaves the files untouched."""
    s = dir_store(tmp_path)
    fill(s.host, [0, 1], [0, 1])
    assert s.write([0, 1], [0, 1], KEYS[:2]).wait()
    before = {f.name: f.stat().st_ino for f in page_files(tmp_path)}
    t = s.write([0, 1], [0, 1], KEYS[:2])
    assert t.wait() and t.statuses == [PageStatus.EXISTS, PageStatus.EXISTS]
    assert {f.name: f.stat().st_ino for f in page_files(tmp_path)} == before
    assert s.status()["pages_already_stored"] == 2
    s.close()


def test_missing_page_fails_the_read_as_lost(tmp_path: Path) -> None:
    """A page the store does not have (deleted behind our back) fails the read with
    ``lost`` set and a MISSING status; the pages that were there are OK."""
    s = dir_store(tmp_path)
    fill(s.host, [0, 1], [0, 1])
    assert s.write([0, 1], [0, 1], KEYS[:2]).wait()
    (tmp_path / f"{KEYS[1].hex()}.page").unlink()
    t = s.read([0, 1], [2, 3], KEYS[:2])
    assert t.wait() is False and t.lost
    assert t.statuses == [PageStatus.OK, PageStatus.MISSING]
    assert t.error is not None and "lost" in t.error
    assert s.exists(KEYS[:2]) == 1
    s.close()


def test_a_fifo_planted_under_a_page_name_fails_the_read_at_once(tmp_path: Path) -> None:
    """A FIFO put in place of a page while the store is open: opening it for the read does
    not wait for a writer (it held an I/O worker forever, the restore until its deadline,
    close() until its timeout and the directory's lock for the life of the process). The read
    fails as a wrong-size page, the other page is served, and the store closes and reopens."""
    s = dir_store(tmp_path, deadline_s=None)
    fill(s.host, [0, 1], [0, 1])
    assert s.write([0, 1], [0, 1], KEYS[:2]).wait()
    f = tmp_path / f"{KEYS[1].hex()}.page"
    f.unlink()
    os.mkfifo(f)
    t = s.read([0, 1], [2, 3], KEYS[:2])
    assert eventually(t.poll)  # a liveness bound: a blocked open never ends
    assert t.ok is False and t.lost and t.statuses == [PageStatus.OK, PageStatus.CORRUPT]
    assert torch.equal(s.host.bytes[2], page_bytes(0))
    s.close()
    s = dir_store(tmp_path)  # the lock was given back
    assert s.exists(KEYS[:1]) == 1
    s.close()


def test_corrupt_page_is_never_served_and_is_deleted(tmp_path: Path) -> None:
    """One flipped payload byte on disk: the read fails (CORRUPT, lost), the file is gone,
    and a read after a restart cannot serve it either."""
    s = dir_store(tmp_path)
    fill(s.host, [0], [0])
    assert s.write([0], [0], KEYS[:1]).wait()
    f = tmp_path / f"{KEYS[0].hex()}.page"
    with f.open("r+b") as fh:
        fh.seek(100)
        b = fh.read(1)
        fh.seek(100)
        fh.write(bytes([b[0] ^ 1]))
    t = s.read([0], [1], KEYS[:1])
    assert t.wait() is False and t.lost and t.statuses == [PageStatus.CORRUPT]
    assert not f.exists() and s.exists(KEYS[:1]) == 0
    s.close()


def test_torn_pages_and_temp_files_are_dropped_at_reopen(tmp_path: Path) -> None:
    """A page file cut short, one with a damaged trailer, and a leftover temp file are
    deleted when the directory is opened; intact pages stay."""
    s = dir_store(tmp_path)
    fill(s.host, list(range(3)), list(range(3)))
    assert s.write(list(range(3)), list(range(3)), KEYS[:3]).wait()
    s.close()
    torn = tmp_path / f"{KEYS[1].hex()}.page"
    os.truncate(torn, G.bytes_per_page // 2)
    bad_trailer = tmp_path / f"{KEYS[2].hex()}.page"
    with bad_trailer.open("r+b") as fh:
        fh.seek(G.bytes_per_page + TRAILER_BYTES - 1)
        fh.write(b"\x00" if fh.read(1) != b"\x00" else b"\x01")
    (tmp_path / f".tmp-{KEYS[3].hex()}-1-0").write_bytes(b"half a page")
    s2 = dir_store(tmp_path)
    assert s2.exists(KEYS[:3]) == 1
    assert [f.name for f in page_files(tmp_path)] == [f"{KEYS[0].hex()}.page"]
    assert not list(tmp_path.glob(".tmp-*"))
    st = s2.status()
    assert st["dropped_at_open"] == 2 and st["temp_removed_at_open"] == 1
    s2.close()


CHILD = r"""
import os, sys, time
from hicache.backends.pools import HostPool
from hicache.backends.stores import open_storage
from tests.backends.store_helpers import G, KEYS, page_bytes

path, mode = sys.argv[1], sys.argv[2]
host = HostPool(G, 1)
store = open_storage("dir", G, host, slots=len(KEYS), path=path, workers=1)
if mode == "block":  # stop for good inside the durability barrier of the third page
    real, calls = os.fdatasync, [0]
    def fdatasync(fd):
        calls[0] += 1
        if calls[0] == 3:
            print("blocked", flush=True)
            time.sleep(3600)
        real(fd)
    os.fdatasync = fdatasync
for i, key in enumerate(KEYS):
    host.bytes[0].copy_(page_bytes(i))
    print(("ok" if store.write([0], [i], [key]).wait() else "fail"), i, flush=True)
"""


def run_and_kill(path: Path, mode: str, after: int) -> list[int]:
    """Start a writer child, SIGKILL it once it printed ``after`` lines; the pages it
    acknowledged."""
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), mode], cwd=repo, stdout=subprocess.PIPE, text=True
    )
    acked: list[int] = []
    try:
        assert child.stdout is not None
        for _ in range(after):  # bounded: the child prints one line per page, or "blocked"
            line = child.stdout.readline()
            if not line:
                break
            word, *rest = line.split()
            if word == "ok":
                acked.append(int(rest[0]))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        if child.stdout is not None:
            child.stdout.close()
    return acked


@pytest.mark.parametrize(("mode", "after"), [("block", 3), ("run", 12)])
def test_sigkill_while_writing_never_serves_a_torn_page(tmp_path: Path, mode: str, after: int) -> None:
    """A writer killed with SIGKILL mid-write (``block``: with a page's bytes written but
    not yet durable; ``run``: at an arbitrary moment) leaves a directory whose every
    page, after reopening, is bit-exact, and which holds every page it acknowledged."""
    acked = run_and_kill(tmp_path, mode, after)
    assert acked, "the child acknowledged nothing"
    if mode == "block":
        assert acked == [0, 1]
        assert list(tmp_path.glob(".tmp-*")), "the blocked page's temp file should be left behind"
    s = open_storage("dir", G, HostPool(G, 1), slots=len(KEYS), path=tmp_path)
    assert not list(tmp_path.glob(".tmp-*"))
    present = [i for i, k in enumerate(KEYS) if s.exists([k])]
    assert set(acked) <= set(present)
    if mode == "block":
        assert present == [0, 1]
    for i in present:
        assert s.read([i], [0], [KEYS[i]]).wait()
        assert torch.equal(s.host.bytes[0], page_bytes(i)), f"page {i} differs"
    s.close()


def test_second_process_gets_a_clear_error_until_the_first_closes(tmp_path: Path) -> None:
    """One opener per directory: a second one gets ConfigError naming the holder (here this
    process: "another cache of this process"; from another process its pid, as
    tests/engine/test_dir_restart.py shows); once the first closes, it opens."""
    s = dir_store(tmp_path)
    with pytest.raises(ConfigError, match="in use by another cache of this process; give each its own"):
        dir_store(tmp_path)
    s.close()
    dir_store(tmp_path).close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_close_lets_go_of_the_directory_while_a_forked_child_lives(tmp_path: Path) -> None:
    """A child forked while the store is open (a worker pool's) shares its locked files:
    ``close()`` unlocks them, so the directory opens again at once, here and elsewhere; the
    child closing its copies does not unlock the parent's."""
    s = dir_store(tmp_path)
    with a_forked_child_lives():
        s.close()
        again = dir_store(tmp_path)  # in use by nobody now
        code = (
            "import sys, pathlib; from tests.backends.store_helpers import dir_store; "
            "dir_store(pathlib.Path(sys.argv[1]))"
        )
        other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                               cwd=Path(__file__).resolve().parents[2])  # fmt: skip
        assert "in use by another cache of this process" not in other.stderr
        assert f"in use by another process (pid {os.getpid()})" in other.stderr, other.stderr[-500:]
        again.close()
    s = dir_store(tmp_path)
    close_in_a_child(s.close)  # a child of an open store closing its copies: the parent's lock stays
    with pytest.raises(ConfigError, match="in use by another cache of this process"):
        dir_store(tmp_path)
    s.close()


def test_size_is_bounded_with_lru_eviction(tmp_path: Path) -> None:
    """At most ``slots`` pages; the least recently used (read or written) go first, and of
    pages written together the last (a prompt's tail, reachable only through its head)."""
    s = dir_store(tmp_path, slots=4)
    fill(s.host, list(range(4)), list(range(4)))
    assert s.write(list(range(4)), list(range(4)), KEYS[:4]).wait()
    assert s.read([0], [7], KEYS[:1]).wait()  # page 0 is now the most recently used
    fill(s.host, [4, 5], [4, 5])
    assert s.write([4, 5], [0, 1], KEYS[4:6]).wait()  # slots are virtual in a keyed store
    have = {i for i in range(6) if s.exists([KEYS[i]])}
    assert have == {0, 1, 4, 5}
    assert len(page_files(tmp_path)) == 4 and s.status()["evicted"] == 2
    s.close()


def test_a_write_never_evicts_the_pages_it_reports_as_stored(tmp_path: Path) -> None:
    """A full store asked for pages it has and one it has not keeps every page it answers
    EXISTS for: the new page is FULL rather than stored in place of one of them."""
    s = dir_store(tmp_path, slots=4)
    fill(s.host, list(range(5)), list(range(5)))
    assert s.write(list(range(4)), list(range(4)), KEYS[:4]).wait()
    # the store itself: the mover's slot check keeps one call within the capacity, but pages
    # of other writers in flight or of an earlier process can leave it this full
    assert s.store.put(list(range(5)), list(range(5)), KEYS[:5]) == [PageStatus.EXISTS] * 4 + [PageStatus.FULL]
    assert s.exists(KEYS[:4]) == 4 and s.status()["evicted"] == 0
    assert s.read([0, 1, 2, 3], [7, 6, 5, 4], KEYS[:4]).wait()
    for p, i in zip([7, 6, 5, 4], range(4), strict=True):
        assert torch.equal(s.host.bytes[p], page_bytes(i))
    s.close()


def test_lru_order_and_bound_survive_a_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Reopened with a smaller capacity, the store keeps the most recently used pages and
    says (a warning) how many it deletes."""
    s = dir_store(tmp_path, slots=4)
    for i in range(4):  # one request each: distinct mtimes in write order
        fill(s.host, [0], [i])
        assert s.write([0], [i], [KEYS[i]]).wait()
        os.utime(tmp_path / f"{KEYS[i].hex()}.page", (1_000_000 + i, 1_000_000 + i))
    s.close()
    with caplog.at_level("WARNING", logger="hicache.backends.stores.dir"):
        s2 = dir_store(tmp_path, slots=2)
    assert [i for i in range(4) if s2.exists([KEYS[i]])] == [2, 3]
    assert "holds 4 pages, more than its capacity of 2: deleting the 2 least recently used" in caplog.text
    s2.close()


def test_refuses_symlinks_foreign_layouts_and_bad_places(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="symlink"):
        dir_store(link)
    with pytest.raises(ConfigError, match="does not exist"):
        dir_store(tmp_path / "missing" / "l3")
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        dir_store(afile)
    with pytest.raises(ConfigError, match=f"parent {afile} is not a directory"):  # not "does not exist"
        dir_store(afile / "l3")
    dir_store(real).close()
    (real / "FORMAT").write_text("hicache-dir-store 1\nbytes_per_page 12345\n")
    with pytest.raises(ConfigError, match="another layout") as bad:
        dir_store(real)
    message = str(bad.value)  # one readable line: both layouts named, no escaped newlines
    assert "bytes_per_page 12345" in message and "\\n" not in message and "\n" not in message


def test_a_symlink_named_like_a_page_is_not_followed(tmp_path: Path) -> None:
    """A symlink planted under a page's name is removed at open; its target is untouched."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * (G.bytes_per_page + TRAILER_BYTES))
    store = tmp_path / "l3"
    dir_store(store).close()
    (store / f"{KEYS[0].hex()}.page").symlink_to(victim)
    s = dir_store(store)
    assert s.exists(KEYS[:1]) == 0 and not (store / f"{KEYS[0].hex()}.page").is_symlink()
    assert victim.read_bytes() == b"x" * (G.bytes_per_page + TRAILER_BYTES)
    s.close()


def test_unenterable_directory_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PermissionError on the way in (a directory we may not enter) is a ConfigError."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    if os.geteuid() == 0:  # root enters anything: emulate the kernel's answer
        real_open = os.open

        def refusing(path: object, flags: int, *args: object, **kw: object) -> int:
            if str(path).startswith(str(locked)):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", refusing)
    else:
        locked.chmod(0)
    with pytest.raises(ConfigError, match="permission denied"):
        dir_store(locked / "l3")


def test_a_directory_of_other_files_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """A non-empty directory without a store is not adopted (opening would delete what
    looks like a broken page or a temp file): nothing is created, deleted or re-moded."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    mine.chmod(0o755)
    for name in ("notes.txt", ".tmp-draft", f"{KEYS[0].hex()}.page"):
        (mine / name).write_bytes(b"user data")
    before = sorted(p.name for p in mine.iterdir())
    with pytest.raises(ConfigError, match="not empty and holds no hicache store"):
        dir_store(mine)
    assert sorted(p.name for p in mine.iterdir()) == before
    assert all((mine / n).read_bytes() == b"user data" for n in before)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755


def test_a_store_being_made_by_another_opener_is_in_use_not_a_strangers_directory(tmp_path: Path) -> None:
    """Two processes opening one new directory at once: the one that finds the other's
    FORMAT.tmp (its store half made, its lock held) is told the store is in use. A FORMAT.tmp
    left by an opener that died before its rename is made over, under the lock."""
    import fcntl

    path = tmp_path / "l3"
    path.mkdir(mode=0o700)
    (path / "FORMAT.tmp").write_bytes(b"hicache-dir-store")  # the other opener, mid-write
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, b"999999\n", 0)
        with pytest.raises(ConfigError, match=r"in use by another process \(pid 999999\)"):
            dir_store(path)
        assert sorted(p.name for p in path.iterdir()) == ["FORMAT.tmp", "LOCK"]  # theirs, untouched
    finally:
        os.close(fd)  # the other opener died before its rename
    s = dir_store(path)
    fill(s.host, [0], [0])
    assert s.write([0], [0], KEYS[:1]).wait()
    s.close()
    assert "FORMAT.tmp" not in {p.name for p in path.iterdir()}
    again = dir_store(path)
    assert again.exists(KEYS[:1]) == 1
    assert again.read([0], [3], KEYS[:1]).wait() and torch.equal(again.host.bytes[3], page_bytes(0))
    again.close()


@pytest.mark.parametrize(
    "kind", ["file", "symlink", "directory", "hard link", "symlink beside LOCK", "hard link beside LOCK"]
)
def test_a_format_tmp_of_the_users_is_never_written_through_or_deleted(tmp_path: Path, kind: str) -> None:
    """A FORMAT.tmp without a LOCK beside it (no opener made it), or one that is not a
    regular file, is a stranger's: refused, left as it was. A regular one beside a LOCK is a
    dead opener's: unlinked and made anew, so a hard link's other name keeps its bytes."""
    path = tmp_path / "l3"
    path.mkdir(mode=0o700)
    outside = tmp_path / "thesis.txt"
    outside.write_bytes(b"three years of work")
    if "LOCK" in kind:
        (path / "LOCK").write_bytes(b"")
    if kind.startswith("symlink"):
        os.symlink(outside, path / "FORMAT.tmp")
    elif kind.startswith("hard link"):
        os.link(outside, path / "FORMAT.tmp")
    elif kind == "directory":
        (path / "FORMAT.tmp").mkdir()
        (path / "FORMAT.tmp" / "important").write_bytes(b"x")
    else:
        (path / "FORMAT.tmp").write_bytes(b"user data")
    before = {
        p.name: (p.lstat().st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
        for p in path.iterdir()
    }
    if kind == "hard link beside LOCK":
        s = dir_store(path)
        s.close()
        assert sorted(p.name for p in path.iterdir()) == ["FORMAT", "LOCK"] and outside.stat().st_nlink == 1
    else:
        with pytest.raises(ConfigError, match="not empty and holds no hicache store"):
            dir_store(path)
        after = {
            p.name: (p.lstat().st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
            for p in path.iterdir()
        }
        assert after == before
    assert outside.read_bytes() == b"three years of work"


def test_an_existing_directory_keeps_its_mode_unless_others_may_write(tmp_path: Path) -> None:
    """An empty directory of mode 0755 is adopted as it is (pages are 0600 files); one
    others may write into is refused, its mode unchanged; a new one is made 0700."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    s = dir_store(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755
    s.close()
    for mode in (0o775, 0o757, 0o2775, 0o1777):
        open_to_all = tmp_path / f"open{mode:o}"
        open_to_all.mkdir()
        open_to_all.chmod(mode)
        with pytest.raises(ConfigError, match="others may write there"):
            dir_store(open_to_all)
        assert stat.S_IMODE(open_to_all.stat().st_mode) == mode and not any(open_to_all.iterdir())
    dir_store(tmp_path / "new").close()
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700


def test_a_directory_where_files_cannot_be_made_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError while setting up the store's files (a read-only or pseudo file system) is
    a ConfigError naming the directory, not a bare OSError."""
    from hicache.backends.stores import dir as dir_module

    def no_lock(dirfd: int, path: Path) -> int:
        raise FileNotFoundError(2, "No such file or directory", "LOCK")

    monkeypatch.setattr(dir_module, "_lock_dir", no_lock)
    with pytest.raises(ConfigError, match="cannot set up its files"):
        dir_store(tmp_path / "l3")


def test_a_directory_held_by_another_process_names_its_pid(tmp_path: Path) -> None:
    """A child process holds the directory (stopped inside a write); opening it here names
    the child's pid."""
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), "block"], cwd=repo, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        lines = [child.stdout.readline() for _ in range(3)]  # bounded: two pages, then "blocked"
        assert lines[-1].strip() == "blocked", lines
        with pytest.raises(ConfigError, match=f"in use by another process \\(pid {child.pid}\\); give each its own"):
            dir_store(tmp_path)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)


def test_a_refusal_for_room_leaves_the_directory_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without room for the store's capacity refuses the store, and a new
    store leaves nothing behind: a directory it made is gone, an empty one stays empty (its
    mode unchanged), a user's lock-file-only directory keeps just that; an existing store
    keeps its FORMAT, lock file and pages. With room again, each opens."""
    real = os.statvfs

    class Full:
        f_bavail, f_frsize, f_blocks = 1, 4096, 1000

    monkeypatch.setattr(os, "statvfs", lambda fd: Full())
    new = tmp_path / "new"
    with pytest.raises(ConfigError, match="more bytes, only 4096 free"):
        dir_store(new)
    assert not new.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    empty.chmod(0o755)
    with pytest.raises(ConfigError, match="more bytes"):
        dir_store(empty)
    assert not any(empty.iterdir()) and stat.S_IMODE(empty.stat().st_mode) == 0o755
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    (locked / "LOCK").write_text("")
    with pytest.raises(ConfigError, match="more bytes"):
        dir_store(locked)
    assert sorted(p.name for p in locked.iterdir()) == ["LOCK"]
    monkeypatch.setattr(os, "statvfs", real)
    store = tmp_path / "store"
    s = dir_store(store)
    fill(s.host, [0], [0])
    assert s.write([0], [0], KEYS[:1]).wait()
    s.close()
    files = sorted(p.name for p in store.iterdir())
    monkeypatch.setattr(os, "statvfs", lambda fd: Full())
    with pytest.raises(ConfigError, match="more bytes"):
        dir_store(store)
    assert sorted(p.name for p in store.iterdir()) == files and "FORMAT" in files
    monkeypatch.setattr(os, "statvfs", real)
    for d in (new, empty, locked, store):
        dir_store(d).close()


def test_eviction_takes_a_prompts_pages_from_its_end(tmp_path: Path) -> None:
    """A prompt's pages are reachable only through the ones before them, so once written or
    read together the first counts as the most recent: a store out of room evicts the last
    pages of the oldest prompt, its head still serves a shorter hit; reopened smaller, the
    store keeps each surviving prompt's head (it kept the tails, which nothing can reach)."""
    a, b = KEYS[:6], KEYS[6:8]
    s = dir_store(tmp_path, slots=6, host_pages=8)
    fill(s.host, list(range(6)), list(range(6)))
    assert s.write(list(range(6)), list(range(6)), a).wait()
    assert s.exists(a) == 6
    assert s.write([0, 1], [0, 1], b).wait()  # full: two of a's pages go, from its end
    assert s.exists(a) == 4 and s.exists(b) == 2
    assert s.read([0, 1, 2, 3], [4, 5, 6, 7], a[:4]).wait()
    for p, i in zip([4, 5, 6, 7], range(4), strict=True):
        assert torch.equal(s.host.bytes[p], page_bytes(i))
    s.close()
    s2 = dir_store(tmp_path, slots=2)  # reopened smaller: the most recent prompt, a[:4], keeps its head
    assert s2.exists(a) == 2 and s2.exists(b) == 0
    s2.close()


def test_a_refused_opener_leaves_a_store_another_made_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two openers of one new directory: the second lists it (empty), the first creates the
    store, writes a page and closes, then the second takes the lock and is refused (another
    layout). Its cleanup removes only what it made: the first's FORMAT and lock file stay,
    and the store reopens with its page."""
    path = tmp_path / "s"
    real = dirmod._check_adoptable

    def listed_before_the_other_opener(dirfd: int, where: Path) -> set[str]:
        names = real(dirfd, where)
        monkeypatch.setattr(dirmod, "_check_adoptable", real)
        first = dir_store(path, slots=8)
        fill(first.host, [0], [0])
        assert first.write([0], [0], KEYS[:1]).wait()
        first.close()
        return names

    monkeypatch.setattr(dirmod, "_check_adoptable", listed_before_the_other_opener)
    other = KVGeometry(2, 2, 64, 8, torch.bfloat16)
    with pytest.raises(ConfigError, match="another layout"):
        dirmod.DirStore(path, HostPool(other, 4), capacity=8)
    assert {"FORMAT", "LOCK"} <= {p.name for p in path.iterdir()} and len(page_files(path)) == 1
    again = dir_store(path, slots=8)
    assert again.read([0], [1], KEYS[:1]).wait() and torch.equal(again.host.bytes[1], page_bytes(0))
    again.close()


def test_a_prompt_stored_in_two_jobs_is_evicted_from_its_end(tmp_path: Path) -> None:
    """A prompt's head, then its extension in a second job (a longer prompt's write-through,
    or a restored head and its tail's backup): with the head's keys given as ``above``, the
    head stays the most recent, so eviction and a smaller reopen keep the pages reachable
    from the first (without it, the extension's job made the tail newer than the head)."""
    path = tmp_path / "s"
    s = dir_store(path, slots=8, host_pages=8)
    fill(s.host, list(range(8)), list(range(8)))
    assert s.write([0, 1, 2, 3], [0, 1, 2, 3], KEYS[:4]).wait()
    assert s.write([4, 5, 6, 7], [4, 5, 6, 7], KEYS[4:8], above=KEYS[:4]).wait()
    assert s.write([0, 1], [0, 1], KEYS[40:42]).wait()  # two unrelated pages: two evictions
    assert s.exists(KEYS[:8]) == 6
    s.close()
    again = dir_store(path, slots=4)  # reopened smaller: keeps the most recent by mtime
    assert again.exists(KEYS[:8]) == 2 and again.exists(KEYS[40:42]) == 2
    assert again.read([0, 1], [2, 3], KEYS[:2]).wait()
    assert torch.equal(again.host.bytes[2], page_bytes(0)) and torch.equal(again.host.bytes[3], page_bytes(1))
    again.close()


def test_a_read_ranks_the_pages_above_it_in_memory_without_touching_their_files(tmp_path: Path) -> None:
    """A read with ``above`` ranks those pages first for eviction in this process, but does
    not stamp their files: its ticket (a restore) does not wait for a syscall per page of
    the prompt's head. Its own pages are stamped."""
    path = tmp_path / "s"
    s = dir_store(path, slots=8, host_pages=8)
    fill(s.host, list(range(8)), list(range(8)))
    assert s.write(list(range(8)), list(range(8)), KEYS[:8]).wait()
    names = [dirmod._name(k) for k in KEYS[:8]]
    before = [os.stat(path / n).st_mtime_ns for n in names]
    assert s.read([4, 5, 6, 7], [0, 1, 2, 3], KEYS[4:8], above=KEYS[:4]).wait()
    after = [os.stat(path / n).st_mtime_ns for n in names]
    assert after[:4] == before[:4] and all(a > b for a, b in zip(after[4:], before[4:], strict=True))
    assert s.write([4, 5], [0, 1], KEYS[40:42]).wait()  # two evictions: the tail's last two
    assert s.exists(KEYS[:8]) == 6
    s.close()


def test_losing_the_race_to_make_the_directory_opens_the_one_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another opener makes the new directory between our check and our mkdir: ours opens
    it (the lock decides who keeps it), not 'File exists'."""
    real = Path.mkdir

    def beaten(self: Path, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        real(self, mode=0o700)  # the other opener's
        raise FileExistsError(17, "File exists", str(self))

    monkeypatch.setattr(Path, "mkdir", beaten)
    s = dir_store(tmp_path / "l3")
    monkeypatch.setattr(Path, "mkdir", real)
    fill(s.host, [0], [0])
    assert s.write([0], [0], KEYS[:1]).wait()
    s.close()
    assert sorted(p.name for p in (tmp_path / "l3").iterdir()) == sorted(["FORMAT", "LOCK", f"{KEYS[0].hex()}.page"])


def test_deleting_the_lock_file_does_not_let_a_second_opener_in(tmp_path: Path) -> None:
    """A cleanup that deletes LOCK while the store is open: the directory itself stays locked,
    so a second opener is still refused (each would keep its own capacity over one directory)."""
    s = dir_store(tmp_path)
    (tmp_path / "LOCK").unlink()
    with pytest.raises(ConfigError, match=r"in use by another process \(its pid is not in the LOCK file\)"):
        dir_store(tmp_path)
    s.close()
    dir_store(tmp_path).close()


def test_a_page_name_in_upper_case_is_dropped_at_open(tmp_path: Path) -> None:
    """Reads open the lower-case name: a file under the upper-case one would be indexed and
    never read nor deleted; it is dropped as any foreign page file is."""
    s = dir_store(tmp_path)
    fill(s.host, [0, 1], [0, 1])
    assert s.write([0, 1], [0, 1], KEYS[:2]).wait()
    s.close()
    lower = tmp_path / (KEYS[0].hex() + ".page")
    lower.rename(tmp_path / (KEYS[0].hex().upper() + ".page"))
    s = dir_store(tmp_path)
    assert s.exists(KEYS[:2]) == 0  # the first page is gone, so no leading page is stored
    assert s.exists(KEYS[1:2]) == 1
    assert [p.name for p in page_files(tmp_path)] == [KEYS[1].hex() + ".page"]
    assert s.store.counts["dropped_at_open"] == 1  # type: ignore[attr-defined]
    s.close()


@pytest.mark.parametrize("name", ["page", "temp"])
def test_a_directory_under_a_page_or_temp_name_is_left_and_the_store_opens(
    tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory is not ours to delete: the store opens, says which entry to remove, never
    reads it, and a page written under its name fails alone."""
    s = dir_store(tmp_path)
    s.close()
    entry = tmp_path / (KEYS[0].hex() + ".page" if name == "page" else ".tmp-7-0")
    entry.mkdir()
    (entry / "inside").write_bytes(b"x")
    s = dir_store(tmp_path)
    assert entry.name in caplog.text and "remove it by hand" in caplog.text
    assert (entry / "inside").read_bytes() == b"x"
    fill(s.host, [0, 1], [0, 1])
    assert s.write([0], [0], KEYS[:1]).wait() is (name == "temp")
    assert s.write([1], [1], KEYS[1:2]).wait()
    assert s.exists(KEYS[1:2]) == 1 and s.read([1], [5], KEYS[1:2]).wait()
    assert torch.equal(s.host.bytes[5], page_bytes(1))
    s.close()


def test_a_name_longer_than_the_system_takes_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"L3 directory .*: File name too long"):
        dir_store(tmp_path / ("n" * 300))


@pytest.mark.parametrize("damage", ["directory", "unreadable"])
def test_a_page_that_cannot_be_read_is_forgotten_not_retried(
    tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page replaced by a directory, or made unreadable, while the store runs: the read
    fails that page and the store forgets it, so the next admission does not try it again;
    the page before it is still served."""
    s = dir_store(tmp_path)
    fill(s.host, [0, 1], [0, 1])
    assert s.write([0, 1], [0, 1], KEYS[:2]).wait()
    name = KEYS[1].hex() + ".page"
    if damage == "directory":
        (tmp_path / name).unlink()
        (tmp_path / name).mkdir()
    else:  # NOTE: root reads a mode-000 file all the same: the open is refused here instead
        real_open = os.open

        def refuse(path: Any, *args: Any, **kwargs: Any) -> int:
            if path == name:
                raise PermissionError(13, "Permission denied")
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", refuse)
    ticket = s.read([0, 1], [4, 5], KEYS[:2])
    assert not ticket.wait() and ticket.statuses[0] is PageStatus.OK
    assert ticket.statuses[1] is (PageStatus.CORRUPT if damage == "directory" else PageStatus.MISSING)
    assert s.exists(KEYS[:2]) == 1
    assert torch.equal(s.host.bytes[4], page_bytes(0))
    s.close()


def test_running_out_of_descriptors_at_open_deletes_no_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE while checking the pages is the process's limit, not a bad page: the open is
    refused and every page is still there for the next one."""
    s = dir_store(tmp_path)
    fill(s.host, [0, 1], [0, 1])
    assert s.write([0, 1], [0, 1], KEYS[:2]).wait()
    s.close()
    real_open = os.open

    def no_descriptors(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(".page"):
            raise OSError(24, "Too many open files")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_descriptors)
    with pytest.raises(ConfigError, match="Too many open files"):
        dir_store(tmp_path)
    monkeypatch.setattr(os, "open", real_open)
    assert len(page_files(tmp_path)) == 2
    s = dir_store(tmp_path)
    assert s.exists(KEYS[:2]) == 2
    s.close()


@pytest.mark.parametrize("damage", ["binary", "text", "empty", "directory", "header then bytes"])
def test_a_damaged_format_file_is_refused_in_a_short_line(tmp_path: Path, damage: str) -> None:
    """A FORMAT file that is not a hicache store's (a page copied over it, a user's text, an
    empty file, a directory in its place) is refused as such, in one short line that quotes
    none of its bytes; the store is left as it was."""
    store = tmp_path / "l3"
    dir_store(store).close()
    fmt = store / "FORMAT"
    junk = {
        "binary": bytes(range(256)) * 40,
        "text": b"my notes\nline two\n",
        "empty": b"",
        "header then bytes": b"hicache-dir-store 1\n" + b"\xff\xfe" * 300,
    }
    if damage == "directory":
        fmt.unlink()
        fmt.mkdir()
    else:
        fmt.write_bytes(junk[damage])
    before = sorted(p.name for p in store.iterdir())
    with pytest.raises(ConfigError, match=r"FORMAT (is a directory|file is not a hicache store's)") as bad:
        dir_store(store)
    message = str(bad.value)
    assert "\n" not in message and len(message) < 150 + len(str(store))
    assert "my notes" not in message and "\\x" not in message
    assert message.endswith(
        {"binary": "(4096+ bytes, not text); give another directory", "text": "(18 bytes); give another directory",
         "empty": "(0 bytes); give another directory"}.get(damage, "give another directory")
    )  # fmt: skip
    assert sorted(p.name for p in store.iterdir()) == before


@pytest.mark.parametrize("stranger", ["text", "directory"])
def test_a_users_directory_with_a_format_file_is_refused_and_left_as_it_was(tmp_path: Path, stranger: str) -> None:
    """A directory that is not a store but holds something named FORMAT (a user's notes): the
    open is refused and leaves no lock file behind (the directory holds what it held)."""
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    if stranger == "text":
        (tmp_path / "FORMAT").write_text("my format notes\n")
    else:
        (tmp_path / "FORMAT").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError, match=r"FORMAT (is a directory|file is not a hicache store's)"):
        dir_store(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_refused_opener_names_the_pid_on_the_lock_files_first_line(tmp_path: Path) -> None:
    """The holder writes its pid over the old one before cutting the old tail: a refused opener
    reads only the first line (a longer pid left behind by an earlier holder is not part of it)."""
    s = dir_store(tmp_path)
    fd = os.open(tmp_path / "LOCK", os.O_WRONLY)
    try:
        os.pwrite(fd, b"4242\n1234567\n", 0)  # as read between the holder's write and its cut
    finally:
        os.close(fd)
    with pytest.raises(ConfigError, match=r"in use by another process \(pid 4242\); give each its own"):
        dir_store(tmp_path)
    s.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
@pytest.mark.parametrize("backend", ["dir", "file"])
def test_a_child_outliving_its_killed_parent_does_not_keep_the_store_locked(tmp_path: Path, backend: str) -> None:
    """A process holding a store forks a child (a worker) and is killed: the child, still
    alive, does not hold the store's lock, so the next cache on the path opens."""
    code = f"""
import os, sys, time, pathlib
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from tests.backends.store_helpers import G, dir_store
from hicache.backends.storage import StorageFile
where = pathlib.Path(sys.argv[1])
store = dir_store(where) if {backend!r} == "dir" else StorageFile(G, 8, where)
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""
    where = tmp_path / ("l3" if backend == "dir" else "l3.bin")
    holder = subprocess.Popen([sys.executable, "-c", code, str(where)], stdout=subprocess.PIPE, text=True)
    child = -1
    try:
        assert holder.stdout is not None
        child = int(holder.stdout.readline())
        holder.kill()
        holder.wait(timeout=30)
        os.kill(child, 0)  # the child lives on
        if backend == "dir":
            dir_store(where).close()
        else:
            StorageFile(G, 8, where).close()
    finally:
        holder.kill()
        holder.wait(timeout=30)
        if child > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
