"""Thread counts that other tests' garbage cannot move.

A cache collected without ``close()`` closes its storage on a ``hicache-l3-close`` thread
started by the collector, at whatever moment it runs. A test that counts threads first
collects what earlier tests dropped and waits for those closes to end.
"""

from __future__ import annotations

import gc
import threading
import time


def settle(timeout_s: float = 30.0) -> None:
    """Collect garbage and wait (bounded) until no dropped cache is still closing."""
    gc.collect()
    deadline = time.monotonic() + timeout_s
    while any(t.name == "hicache-l3-close" for t in threading.enumerate()):
        if time.monotonic() > deadline:
            raise AssertionError("a dropped cache's storage did not close in time")
        time.sleep(0.01)


def named(prefix: str) -> int:
    """Live threads whose name starts with ``prefix``."""
    return sum(t.name.startswith(prefix) for t in threading.enumerate())
