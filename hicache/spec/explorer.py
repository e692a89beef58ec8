"""Exhaustive small-scope exploration: every interleaving of operations to a bounded depth.

Generic over an :class:`Explorable` system (``hicache.testing.explore_core`` binds it to
the real core with a fake backend whose completions the explorer schedules). Breadth-first
from the initial state; states are deduplicated by a canonical key, so every interleaving
up to ``depth`` is covered up to state equality. Every invariant of
:mod:`hicache.spec.invariants` (plus the system's own checks) is verified in every state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol, Self

from hicache.spec.invariants import Violation, check_all
from hicache.spec.model import Event, RunState
from hicache.spec.snapshot import Snapshot


class Explorable(Protocol):
    def actions(self) -> list[str]:
        """Operations enabled now, in a deterministic order."""

    def apply(self, action: str) -> None:
        """Perform one enabled operation."""

    def clone(self) -> Self:
        """An independent copy."""

    def key(self) -> Hashable:
        """A canonical key: equal keys mean equal states."""

    def snapshot(self) -> Snapshot:
        """The plain-data view the invariants are checked on."""

    def check(self) -> list[Violation]:
        """System-specific checks beyond the structural invariants (content, ordering)."""

    def coverage(self) -> set[tuple[RunState, Event]]:
        """Spec transitions taken on the way to this state."""


@dataclass
class ExploreReport:
    states: int = 0
    edges: int = 0
    depth: int = 0
    frontier_left: int = 0
    seconds: float = 0.0
    transitions: set[tuple[RunState, Event]] = field(default_factory=set)
    violations: list[tuple[list[str], Violation]] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.states} states, {self.edges} edges, depth {self.depth}, "
            f"{len(self.transitions)} spec transitions, {len(self.violations)} violations, "
            f"{self.seconds:.1f}s"
        )


def explore(
    initial: Explorable,
    depth: int,
    *,
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> ExploreReport:
    """Breadth-first over all interleavings up to ``depth`` operations (see module doc).

    Stops at the first violation (recorded with the action trace that reached it).
    """
    t0 = time.perf_counter()
    report = ExploreReport()
    seen = {initial.key()}
    level: list[tuple[Explorable, list[str]]] = [(initial, [])]
    report.states = 1
    for d in range(depth + 1):
        nxt: list[tuple[Explorable, list[str]]] = []
        for system, trace in level:
            bad = check_all(system.snapshot()) + system.check()
            report.transitions |= system.coverage()
            if bad:
                report.violations.append((trace, bad[0]))
                report.seconds = time.perf_counter() - t0
                return report
            if d == depth:
                continue
            for action in system.actions():
                child = system.clone()
                child.apply(action)
                report.edges += 1
                k = child.key()
                if k in seen:
                    continue
                seen.add(k)
                report.states += 1
                nxt.append((child, [*trace, action]))
                if max_states is not None and report.states >= max_states:
                    break
        report.depth = d
        if progress is not None:
            progress(d, report.states, report.edges)
        if not nxt:
            break
        level = nxt
    report.frontier_left = len(level) if report.depth == depth else 0
    report.seconds = time.perf_counter() - t0
    return report
