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


# A call still running at exit (its thread ends once a gate opens), and an exit handler of
# the program's or a library's that says what the exit still waits for when it runs.
ORDER = r"""
import atexit, sys, threading
from hicache.backends.stores import at_exit

how = sys.argv[1]
gates = [threading.Event() for _ in range(2)]
calls = [threading.Thread(target=g.wait, args=(30,), daemon=True) for g in gates]
for t in calls:
    t.start()

def opener():  # the calls return as the interpreter ends
    for g in gates:
        g.wait(0.2)
        g.set()

def handler():
    if how == "closes":  # the program closes its cache at exit: the store's call outlives close()
        at_exit.wait_at_exit(lambda: not calls[1].is_alive(), 30.0, "call B")
    print("the handler ran; the exit still waits for:", at_exit.pending(), flush=True)

if how == "library":
    at_exit.wait_at_exit(lambda: not calls[0].is_alive(), 30.0, "call A")
atexit.register(handler)  # a library's, initialised lazily after the first wait; or the program's
if how == "library":
    at_exit.wait_at_exit(lambda: not calls[1].is_alive(), 30.0, "call B")
threading.Thread(target=opener, daemon=True).start()
"""


@pytest.mark.parametrize("how", ["library", "closes"])
def test_an_exit_handler_registered_after_a_wait_does_not_get_ahead_of_it(how: str) -> None:
    """A library's exit handler registered after the first wait (a client initialised on its
    first call) runs after the exit has waited for every call, those registered after it
    included (it ran first, tearing the library down under a call still inside it); a wait
    registered by an exit handler (a program that closes its cache at exit) is waited for
    there (Python calls no exit handler registered while they run: it was skipped)."""
    run = subprocess.run([sys.executable, "-c", ORDER, how], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "the handler ran; the exit still waits for: []", (run.stdout, run.stderr)
