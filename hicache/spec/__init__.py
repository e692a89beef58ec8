"""The formal model of a page run: states, events, guards, invariants, explorer."""

from hicache.spec.invariants import INVARIANTS, Violation, check_all
from hicache.spec.model import (
    TABLE,
    Direction,
    Event,
    RunMachine,
    RunState,
    Tier,
    reachable,
    state_of,
    step,
)

__all__ = [
    "INVARIANTS",
    "TABLE",
    "Direction",
    "Event",
    "RunMachine",
    "RunState",
    "Tier",
    "Violation",
    "check_all",
    "reachable",
    "state_of",
    "step",
]
