"""The fault injector's ``hang``: a release reaches every operation that has taken one."""

from __future__ import annotations

import threading
import time

from hicache.backends.faults import Fault, FaultInjector


def _hang_in_thread(inj: FaultInjector, fault: Fault) -> threading.Thread:
    t = threading.Thread(target=inj.hang, args=(fault,), daemon=True)
    t.start()
    return t


def test_a_release_between_take_and_hang_lets_the_operation_through() -> None:
    """An I/O thread takes its hang, then the test releases (teardown), then the thread
    reaches ``hang``: it goes on at once instead of blocking for its hour."""
    inj = FaultInjector()
    inj.add("hang", op="read")
    fault = inj.take("read")
    assert fault is not None and fault.kind == "hang"
    inj.release()
    t = _hang_in_thread(inj, fault)
    t.join(timeout=10)
    assert not t.is_alive() and inj.hanging == 0


def test_a_hang_taken_after_a_release_blocks_until_the_next() -> None:
    inj = FaultInjector()
    inj.release()
    inj.add("hang", op="write", count=2)
    first, second = inj.take("write"), inj.take("write")
    assert first is not None and second is not None
    threads = [_hang_in_thread(inj, first), _hang_in_thread(inj, second)]
    deadline = time.monotonic() + 10
    while inj.hanging < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inj.hanging == 2 and all(t.is_alive() for t in threads)
    inj.release()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads) and inj.hanging == 0


def test_a_taken_fault_equals_the_one_queued() -> None:
    """What ``take`` returns compares and prints as the fault that was added."""
    inj = FaultInjector()
    inj.add("hang", op="read", delay_s=2.0)
    fault = inj.take("read")
    assert fault == Fault("hang", "read", 2.0) and repr(fault) == repr(Fault("hang", "read", 2.0))
