"""The facade under arbitrary request/transfer interleavings, scheduled and real backends."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hicache.testing.facade_machine import FacadeMachine, RealBackendsMachine


def test_facade_with_scheduled_transfers() -> None:
    """Transfers complete, fail or wait in any order; content and integrity hold."""
    current = settings()
    run_state_machine_as_test(
        FacadeMachine, settings=settings(current, max_examples=max(50, current.max_examples // 4))
    )


def test_facade_with_real_cpu_backends_and_faults() -> None:
    """Real L2 memory and L3 file on I/O threads, with injected storage/transfer faults."""
    current = settings()
    run_state_machine_as_test(
        RealBackendsMachine, settings=settings(current, max_examples=max(30, current.max_examples // 8))
    )
