"""The asynchronous L3 face (``StoreMover``): deadlines, stragglers, bounded close, read
priority, keyed requests, ``exists`` and degraded stores; and ``open_storage``."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.backends.faults import FaultInjector
from hicache.backends.pools import HostPool
from hicache.backends.stores import PageStatus, StoreMover, open_storage
from hicache.backends.stores.base import Op
from hicache.errors import ConfigError, MisuseError
from tests.backends.store_helpers import KEYS, G, dir_store, eventually, fill, page_bytes
from tests.threads import settle


def file_store(**kw: Any) -> StoreMover:
    host = HostPool(G, 8)
    host.bytes.copy_(torch.randint(0, 256, host.bytes.shape, dtype=torch.uint8))
    return open_storage("file", G, host, slots=8, **kw)


def test_file_store_round_trip_through_open_storage() -> None:
    """The default store moves pages bit-exactly, scattered on both sides."""
    s = file_store()
    want = s.host.bytes[[0, 3, 4]].clone()
    assert s.write([0, 3, 4], [7, 2, 3]).wait()
    assert s.read([7, 2, 3], [1, 5, 6]).wait()
    assert torch.equal(s.host.bytes[[1, 5, 6]], want)
    assert not s.keyed and not s.shared and s.exists(KEYS[:2]) == 0
    s.close()


def test_a_hung_read_fails_at_its_deadline_and_holds_its_pages_until_it_returns() -> None:
    """Past its deadline a read fails (``expired``); the pages its running I/O touches are
    listed as held and the ticket is not settled; once the I/O returns, ``reap`` lists it
    once, settled."""
    s = file_store(deadline_s=0.2, deadline_s_per_gib=0.0, workers=1)
    assert s.write([0, 1], [0, 1]).wait()
    s.faults.add("hang", op="read")
    t = s.read([0, 1], [4, 5])
    assert t.wait() is False and t.expired and t.error is not None and "deadline" in t.error
    assert sorted(t.held_host_pages) == [4, 5] and sorted(t.held_slots) == [0, 1]
    assert not t.settled and s.reap() == []
    s.faults.release()
    got: list[Any] = []

    def reaped() -> bool:
        got.extend(s.reap())
        return bool(got)

    assert eventually(reaped)
    assert got == [t] and [x.settled for x in got] == [True] and s.reap() == []
    s.close()


def test_chunks_not_started_by_the_deadline_never_start() -> None:
    """Only the chunk that was running is held; the queued ones are skipped and never
    touch their destination pages."""
    s = file_store(deadline_s=0.2, deadline_s_per_gib=0.0, workers=1, chunk_pages=1)
    assert s.write([0, 1, 2], [0, 1, 2]).wait()
    s.host.bytes[5:8].fill_(7)
    s.faults.add("hang", op="read")
    t = s.read([0, 1, 2], [5, 6, 7])
    assert t.wait() is False
    assert t.held_host_pages == [5] and t.statuses[1:] == [PageStatus.SKIPPED] * 2
    s.faults.release()
    assert eventually(lambda: bool(s.reap()))
    assert s.read([0], [0]).wait()  # the worker has moved on past the skipped chunks
    assert bool((s.host.bytes[6:8] == 7).all())
    s.close()


def test_close_returns_with_a_hung_io_and_the_store_closes_when_it_ends() -> None:
    """close(wait=True) is bounded by close_timeout_s even when an I/O never returns; the
    unfinished request fails; the file is closed only once the straggler is gone."""
    s = file_store(close_timeout_s=0.2)
    store: Any = s.store
    s.faults.add("hang", op="write")
    t = s.write([0], [0])
    closer = threading.Thread(target=s.close)
    closer.start()
    closer.join(60)  # a liveness bound: close must not wait for the hung write
    assert not closer.is_alive()
    assert t.wait() is False and t.expired and not store.file.closed
    s.faults.release()
    assert eventually(lambda: bool(store.file.closed))


def test_close_without_wait_cancels_queued_work() -> None:
    s = file_store(workers=1)
    s.faults.add("hang", op="write")
    first = s.write([0], [0])
    for _ in range(2000):  # NOTE: bounded; the one worker must be inside the hung write first
        if s.status()["io_running"]:
            break
        time.sleep(0.005)
    assert s.status()["io_running"] == 1
    queued = s.write([1], [1])
    s.close(wait=False)
    assert queued.wait() is False and queued.statuses == [PageStatus.SKIPPED]
    assert first.wait() is False
    s.faults.release()
    with pytest.raises(ConfigError, match="closed"):
        s.write([0], [0])


def test_reads_go_before_queued_writes() -> None:
    """With the one I/O thread busy, a read queued after a write is served first."""
    s = file_store(workers=1)
    s.faults.add("hang", op="write")
    blocker = s.write([0], [0])
    assert eventually(lambda: s.faults.hanging == 1)
    later_write = s.write([1], [1])
    read = s.read([2], [2])
    s.faults.release()
    assert blocker.wait() and later_write.wait() and read.wait() is False  # slot 2 never written
    assert read.finished_at is not None and later_write.finished_at is not None
    assert read.finished_at < later_write.finished_at
    s.close()


def test_keyed_requests_need_well_formed_keys(tmp_path: Path) -> None:
    s = dir_store(tmp_path)
    for keys in (None, KEYS[:1], [b"short", KEYS[1]], ["0" * 32, KEYS[1]]):
        with pytest.raises(MisuseError):
            s.write([0, 1], [0, 1], keys)  # type: ignore[arg-type]
    s.close()


class FakeRemote:
    """A remote PageStore whose ``exists`` can be made to hang."""

    kind = "fake"
    keyed = True
    shared = True
    remote = True

    def __init__(self, available: bool = True) -> None:
        self.available = available
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0

    def plan(self, op: Op, host_pages: Sequence[int], slots: Sequence[int]) -> tuple[list[tuple[int, int]], int]:
        return [(0, len(slots))], 1

    def put(self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None) -> list[PageStatus]:
        return [PageStatus.OK] * len(slots)

    def get(self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None) -> list[PageStatus]:
        return [PageStatus.MISSING] * len(slots)

    def exists(self, keys: Sequence[bytes]) -> int:
        self.calls += 1
        self.gate.wait(60)
        return len(keys)

    def close(self) -> None:
        self.gate.set()

    def status(self) -> dict[str, Any]:
        return {"error": None if self.available else "down"}


def test_exists_on_a_remote_store_is_bounded_in_keys_and_time() -> None:
    """At most ``exists_pages`` keys per call; a hung call answers 0 after the timeout,
    and later calls answer 0 at once (no pile-up) until it returns."""
    fake = FakeRemote()
    s = StoreMover(fake, HostPool(G, 2), slots=8, exists_pages=3, exists_timeout_s=0.1)
    assert s.exists(KEYS[:10]) == 3
    fake.gate.clear()
    assert s.exists(KEYS[:2]) == 0
    assert s.exists(KEYS[:2]) == 0 and fake.calls == 2  # the second did not reach the store
    fake.gate.set()
    assert eventually(lambda: s.exists(KEYS[:2]) == 2)
    assert fake.calls == 3  # no stale call queued behind the hung one ran later
    assert s.status()["exists_timeouts"] >= 2
    s.close()


def test_an_unavailable_store_degrades_to_no_l3() -> None:
    """Requests fail at once (counted), exists answers 0; nothing raises."""
    s = StoreMover(FakeRemote(available=False), HostPool(G, 2), slots=8)
    t = s.read([0], [0], KEYS[:1])
    assert t.ok is False and t.error is not None and "unavailable" in t.error
    assert s.exists(KEYS[:1]) == 0 and not s.available
    assert s.status()["unavailable"] == 1
    s.close()


def test_a_read_of_pages_gone_from_a_shared_store_is_lost() -> None:
    s = StoreMover(FakeRemote(), HostPool(G, 2), slots=8)
    t = s.read([0, 1], [0, 1], KEYS[:2])
    assert t.wait() is False and t.lost and s.status()["lost_pages"] == 2
    s.close()


@pytest.mark.parametrize(
    ("kind", "kw", "match"),
    [
        ("nfs", {}, "storage backend must be one of"),
        ("file", {"extra": {"fsync": True}}, "no extra config"),
        ("dir", {}, "needs a path"),
        ("dir", {"path": "P", "extra": {"fsnc": False}}, "unknown keys"),
        ("dir", {"path": "P", "extra": {"fsync": "no"}}, "must be a bool"),
        ("dir", {"path": "P", "direct": True}, "direct"),
        ("dir", {"path": "P", "workers": 0}, "workers"),
        ("dir", {"path": "P", "deadline_s": -1.0}, "deadline_s"),
        ("dir", {"path": "P", "chunk_pages": 0}, "chunk_pages"),
        ("mooncake", {"extra": {}}, "master_server_address"),
        ("mooncake", {"extra": {"master_server_address": "nohost"}}, "host:port"),
        ("mooncake", {"extra": {"master_server_address": "h:99999"}}, r"port 99999 is not in \[1, 65535\]"),
        ("mooncake", {"extra": {"master_server_address": "h:0"}}, r"port 0 is not in \[1, 65535\]"),
        ("mooncake", {"extra": {"master_server_address": "h:1", "protocol": "udp"}}, "protocol"),
        ("mooncake", {"extra": {"master_server_address": "h:1", "global_segment_size": "lots"}}, "size"),
        ("mooncake", {"extra": {"master_server_address": "h:1", "masterr": 1}}, "unknown keys"),
        ("mooncake", {"path": "P", "extra": {"master_server_address": "h:1"}}, "no path"),
    ],
)
def test_bad_configuration_is_refused_before_anything_opens(
    tmp_path: Path, kind: str, kw: dict[str, Any], match: str
) -> None:
    """Every bad setting is a ConfigError raised before a file, directory or thread exists."""
    kw = {k: (tmp_path / "l3" if v == "P" else v) for k, v in kw.items()}
    settle()
    threads = threading.active_count()
    with pytest.raises(ConfigError, match=match):
        open_storage(kind, G, HostPool(G, 2), slots=4, **kw)
    assert not (tmp_path / "l3").exists() and threading.active_count() == threads


def test_a_failure_after_opening_closes_what_was_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the mover cannot start, the directory store it opened is closed (unlocked)."""

    def broken(self: StoreMover, *args: Any, **kw: Any) -> None:
        raise RuntimeError("no threads")

    with monkeypatch.context() as m:
        m.setattr(StoreMover, "__init__", broken)
        with pytest.raises(RuntimeError):
            dir_store(tmp_path)
    dir_store(tmp_path).close()  # not locked any more


def test_page_statuses_and_counters_on_a_mixed_write(tmp_path: Path) -> None:
    s = dir_store(tmp_path, faults=FaultInjector())
    fill(s.host, [0, 1], [0, 1])
    assert s.write([0], [0], KEYS[:1]).wait()
    t = s.write([0, 1], [0, 1], KEYS[:2])
    assert t.wait() and t.statuses == [PageStatus.EXISTS, PageStatus.OK]
    assert s.read([0, 1], [2, 3], KEYS[:2]).wait()
    assert torch.equal(s.host.bytes[3], page_bytes(1))
    st = s.status()
    assert (st["writes"], st["reads"], st["pages_already_stored"], st["pages"]) == (2, 1, 1, 2)
    s.close()


def test_status_is_json_serializable(tmp_path: Path) -> None:
    import json

    for s in (file_store(), dir_store(tmp_path)):
        json.dumps(s.status())
        s.close()


def test_deadline_grows_with_the_request_size() -> None:
    """A request's deadline is deadline_s plus deadline_s_per_gib per GiB it moves."""
    s = file_store(deadline_s=1.0, deadline_s_per_gib=2**30 / G.bytes_per_page)  # 1 s per page
    t = s.write([0, 1, 2], [0, 1, 2])
    assert t.deadline - t.started == pytest.approx(4.0)
    assert t.wait()
    s.close()


def test_a_store_failing_by_status_is_logged_when_it_starts_and_when_it_recovers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A store whose writes come back FAILED raises nothing (a remote store whose server went
    away): the mover says so at the first failure, not at every one while it lasts, and
    again once a request goes through. Pages merely gone from a shared store are no failure."""
    from hicache.backends.stores import mover as mover_module
    from hicache.testing.memory_store import MemoryStore

    monkeypatch.setattr(mover_module, "FAILING_WARN_S", 1e9)  # no repeat within the test
    broken = {"on": True}

    class Failing(MemoryStore):
        def put(
            self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None
        ) -> list[PageStatus]:
            if broken["on"]:
                return [PageStatus.FAILED] * len(host_pages)
            return super().put(host_pages, slots, keys)

    host = HostPool(G, 8)
    s = StoreMover(Failing(host), host, slots=8, workers=1)
    caplog.set_level("WARNING", logger="hicache.backends.stores.mover")
    for i in range(4):
        assert s.write([0], [i], KEYS[i : i + 1]).wait() is False
    failing = [r.getMessage() for r in caplog.records if "failing" in r.getMessage()]
    assert len(failing) == 1 and "memory store failing (1 requests in a row)" in failing[0]
    assert s.status()["failing_in_a_row"] == 4
    assert s.read([1], [7], KEYS[7:8]).wait() is False  # lost from the store: not a failure
    assert not any("works again" in r.getMessage() for r in caplog.records)
    broken["on"] = False
    assert s.write([0], [0], KEYS[:1]).wait()
    again = [r.getMessage() for r in caplog.records if "works again" in r.getMessage()]
    assert again == ["hicache L3: the memory store works again after 4 failed requests"]
    assert s.status()["failing_in_a_row"] == 0
    s.close()


def test_a_flapping_or_hung_store_is_logged_once_per_period(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A store failing every other request logs its failure once per period, not at each new
    streak; a hung store's requests, failed at their deadline, count as failures too."""
    from hicache.backends.stores import mover as mover_module
    from hicache.testing.memory_store import MemoryStore

    monkeypatch.setattr(mover_module, "FAILING_WARN_S", 1e9)
    calls = {"n": 0}

    class Flapping(MemoryStore):
        def put(
            self, host_pages: Sequence[int], slots: Sequence[int], keys: Sequence[bytes] | None
        ) -> list[PageStatus]:
            calls["n"] += 1
            if calls["n"] % 2:
                return [PageStatus.FAILED] * len(host_pages)
            return super().put(host_pages, slots, keys)

    host = HostPool(G, 8)
    s = StoreMover(Flapping(host), host, slots=8, workers=1)
    caplog.set_level("WARNING", logger="hicache.backends.stores.mover")
    outcomes = [s.write([0], [i % 8], KEYS[i % 8 : i % 8 + 1]).wait() for i in range(20)]
    assert outcomes == [False, True] * 10
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failing" in m for m in messages) == 1 and sum("works again" in m for m in messages) == 1
    s.close()

    caplog.clear()
    hung = file_store(deadline_s=0.2, deadline_s_per_gib=0.0, workers=1)
    hung.faults.add("hang", op="write")
    assert hung.write([0], [0]).wait() is False
    assert hung.status()["failing_in_a_row"] == 1
    assert sum("failing" in r.getMessage() for r in caplog.records) == 1
    hung.faults.release()
    hung.close()


class _Interrupt(KeyboardInterrupt):
    """Ctrl-C, as Python raises it between two bytecodes of an interruptible issue."""


@pytest.mark.parametrize("where", ["host fence", "slot fence", "queue", "queued"])
def test_an_interrupt_while_a_copy_is_issued_leaves_nothing_waiting_on_it(where: str) -> None:
    """Issuing a copy is interruptible (a mover may block): an interrupt once the job is
    registered and fenced but not (or just) queued reaches the caller, and no ticket that no
    one holds is left fenced on the pages (the next copy of those slots waited on it until
    its deadline, with none for good). Then every page moves bit-exactly."""
    s = file_store(deadline_s=None, workers=1)
    try:
        obj, name = {
            "host fence": (s.host, "fence"),
            "slot fence": (s._slot_fences, "fence"),
            "queue": (s._queue, "put"),
            "queued": (s._queue, "put"),
        }[where]
        real = getattr(obj, name)

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            setattr(obj, name, real)
            if where == "queued":
                real(*args, **kwargs)
            raise _Interrupt(where)

        setattr(obj, name, interrupted)
        with pytest.raises(_Interrupt):
            s.write([0, 1], [2, 3])
        assert getattr(obj, name) == real
        want = s.host.bytes[[0, 1]].clone()
        done = threading.Event()
        result: list[bool] = []

        def copies() -> None:  # the next copies of those slots and pages
            result.append(s.write([0, 1], [2, 3]).wait() and s.read([2, 3], [4, 5]).wait())
            done.set()

        threading.Thread(target=copies, daemon=True).start()
        assert done.wait(120), "the next copy of those slots waits on a ticket no one holds"
        assert result == [True] and torch.equal(s.host.bytes[[4, 5]], want)
        assert eventually(lambda: not s._active)
    finally:
        s.close()


class _CutEvent(threading.Event):
    """A job's event whose first wait is cut short by Ctrl-C."""

    def __init__(self, inner: threading.Event) -> None:
        super().__init__()
        self.inner = inner
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if self.waits == 1:
            raise _Interrupt("close's wait")
        return self.inner.wait(timeout)

    def set(self) -> None:
        self.inner.set()

    def is_set(self) -> bool:
        return self.inner.is_set()


def test_a_close_cut_short_while_it_waits_for_a_job_still_closes_the_store(tmp_path: Path) -> None:
    """Ctrl-C while close waits for a write in the store (hung): close stops waiting, fails
    the write, and the store closes as the write returns (the path opens again); a second
    close returns at once."""
    s = dir_store(tmp_path / "d", deadline_s=None, workers=1)
    s.faults.add("hang", op="write")
    fill(s.host, [0], [0])
    ticket = s.write([0], [0], KEYS[:1])
    assert eventually(lambda: s.faults.hanging == 1)
    (job,) = s._active
    job.event = _CutEvent(job.event)
    with pytest.raises(_Interrupt):
        s.close()
    assert s.closed and s.shut and job.event.waits == 1
    s.close()  # returns: the store closes when the write returns
    with pytest.raises(ConfigError, match="in use"):
        dir_store(tmp_path / "d")
    s.faults.release()
    assert ticket.wait() is False  # failed by the close, not reported stored
    assert eventually(lambda: s.status()["io_running"] == 0)

    def opens() -> bool:
        try:
            dir_store(tmp_path / "d").close()
        except ConfigError:
            return False
        return True

    assert eventually(opens), "the store stays open and locked after a close cut short"
