"""What the interpreter's exit waits for (``hicache/backends/stores/at_exit.py``): a remote
store's calls that outlived ``close()`` until the store's own close has returned, a wait
registered while the exit already waits, all within the longest bound."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hicache.backends.stores import at_exit

ROOT = Path(__file__).resolve().parents[2]

SLOW_REMOTE = r"""
import sys, threading, time
import torch
from hicache.backends.pools import HostPool
from hicache.backends.stores import at_exit
from hicache.backends.stores.base import PageStatus
from hicache.backends.stores.mover import StoreMover
from hicache.core.geometry import KVGeometry

MARK = sys.argv[1]
gate = threading.Event()  # the put returns once the mover's close() has given up on it

class SlowRemote:
    kind, keyed, shared, remote, available = "slowremote", True, True, True, True
    def plan(self, op, hp, sl): return [(0, len(sl))], 1
    def put(self, hp, sl, keys):
        gate.wait(30)
        return [PageStatus.OK] * len(sl)
    def get(self, hp, sl, keys): return [PageStatus.MISSING] * len(sl)
    def exists(self, keys): return 0
    def close(self):  # as MooncakeStore's: the native close on a thread, joined for a while
        def native_close():
            time.sleep(0.5)
            open(MARK, "w").write("closed")
        t = threading.Thread(target=native_close, daemon=True)
        t.start()
        t.join(0.05)
        if t.is_alive():
            at_exit.wait_at_exit(lambda: not t.is_alive(), 30.0, "the slow store's close")
    def status(self): return {}

g = KVGeometry(num_layers=1, page_size=2, num_kv_heads=1, head_dim=4, dtype=torch.float16)
m = StoreMover(SlowRemote(), HostPool(g, 4), slots=8, close_timeout_s=0.1)
m.write([0], [0], [b"k" * 16])
m.close()  # the put is still running: the store closes when it returns
assert at_exit.pending() == ["slowremote store calls still running past close()"], at_exit.pending()
gate.set()  # it returns now, as the interpreter starts to end
print("EXITING", flush=True)
"""


def test_the_exit_waits_until_a_remote_stores_close_has_returned(tmp_path: Path) -> None:
    """The put outlives ``close()``; the exit waits for it, then for the store's close, which
    itself registers a wait for its native part while the exit is already waiting."""
    mark = tmp_path / "closed"
    run = subprocess.run(
        [sys.executable, "-c", SLOW_REMOTE, str(mark)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert run.returncode == 0 and "EXITING" in run.stdout, run.stderr[-2000:]
    assert mark.read_text() == "closed"  # the store's close ran to its end before the process did


def test_the_waits_share_one_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three waits that never end, each bounded by 5 s: the exit waits 5 s in all, not 15
    (a fake clock: the test does not depend on the machine's speed)."""
    now = [0.0]
    monkeypatch.setattr(at_exit, "_clock", lambda: now[0])
    monkeypatch.setattr(at_exit, "_sleep", lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(at_exit, "_waits", [])
    for i in range(3):
        at_exit.wait_at_exit(lambda: False, 5.0, f"stuck {i}")
    at_exit._wait_all()
    assert 5.0 <= now[0] < 5.0 + 2 * at_exit._POLL_S
    assert at_exit._waits == []
