"""Exhaustive small-scope exploration: every interleaving of operations to a bounded depth.

Generic over an :class:`Explorable` system (``hicache.testing.explore_core`` binds it to
the real core with a fake backend whose completions the explorer schedules). Breadth-first
from the initial state. Every successor of every expanded state is checked and its
coverage counted *before* it is deduplicated, so an edge into a state seen before is still
verified; only then are states with equal canonical keys merged (the key must hold
everything that can change what happens next, or the merge would hide states).

Coverage is per model: ``coverage()`` maps a model name (``"run"`` for the page-run
model, ``TABLE``'s keys) to the transitions taken on the way to the state, and
``universe`` gives each model's full set, so a report says what was never reached.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Self

from hicache.errors import MisuseError
from hicache.flags import ArgParser, positive_int
from hicache.spec.invariants import Violation

Coverage = Mapping[str, Collection[Hashable]]
"""Model name -> transitions taken (for the page-run model: ``(RunState, Event)`` pairs)."""


class Explorable(Protocol):
    def actions(self) -> list[str]:
        """Operations enabled now, in a deterministic order."""

    def apply(self, action: str) -> None:
        """Perform one enabled operation."""

    def clone(self) -> Self:
        """An independent copy."""

    def key(self) -> Hashable:
        """A canonical key: equal keys mean states that behave the same from now on."""

    def check(self) -> list[Violation]:
        """Every check of this state: structural invariants and system-specific ones."""

    def coverage(self) -> Coverage:
        """Per model, the transitions taken on the way to this state."""


@dataclass
class ExploreReport:
    states: int = 0
    edges: int = 0
    depth: int = 0
    frontier_left: int = 0
    seconds: float = 0.0
    covered: dict[str, set[Hashable]] = field(default_factory=dict)
    universe: dict[str, frozenset[Hashable]] = field(default_factory=dict)
    violations: list[tuple[list[str], Violation]] = field(default_factory=list)

    @property
    def transitions(self) -> set[Hashable]:
        """Page-run transitions covered (the ``"run"`` model)."""
        return self.covered.get("run", set())

    def missing(self, model: str) -> set[Hashable]:
        """Transitions of ``model``'s universe never taken."""
        return set(self.universe.get(model, frozenset())) - self.covered.get(model, set())

    def summary(self) -> str:
        models = sorted(set(self.covered) | set(self.universe))
        cov = ", ".join(
            f"{m} {len(self.covered.get(m, ()))}/{len(self.universe[m])}"
            if m in self.universe
            else f"{m} {len(self.covered.get(m, ()))}"
            for m in models
        )
        return (
            f"{self.states} states, {self.edges} edges, depth {self.depth}, "
            f"transitions {cov or 'none'}, {len(self.violations)} violations, {self.seconds:.1f}s"
        )


def explore(
    initial: Explorable,
    depth: int,
    *,
    universe: Mapping[str, Collection[Hashable]] | None = None,
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> ExploreReport:
    """Breadth-first over all interleavings up to ``depth`` operations (see module doc).

    Stops at the first violation (recorded with the action trace that reached it).
    ``progress(depth, states, edges)`` is called after each level.
    """
    t0 = time.perf_counter()
    report = ExploreReport(universe={m: frozenset(u) for m, u in (universe or {}).items()})

    def visit(system: Explorable, trace: list[str]) -> bool:
        for model, taken in system.coverage().items():
            report.covered.setdefault(model, set()).update(taken)
        bad = system.check()
        if bad:
            report.violations.append((trace, bad[0]))
        return not bad

    ok = visit(initial, [])
    seen = {initial.key()}
    report.states = 1
    level: list[tuple[Explorable, list[str]]] = [(initial, [])]
    d = 0
    while ok and level and d < depth and (max_states is None or report.states < max_states):
        nxt: list[tuple[Explorable, list[str]]] = []
        for system, trace in level:
            for action in system.actions():
                child = system.clone()
                child.apply(action)
                report.edges += 1
                path = [*trace, action]
                if not visit(child, path):
                    ok = False
                    break
                k = child.key()
                if k in seen:
                    continue
                seen.add(k)
                report.states += 1
                nxt.append((child, path))
                if max_states is not None and report.states >= max_states:
                    break
            if not ok or (max_states is not None and report.states >= max_states):
                break
        d += 1
        report.depth = d
        if progress is not None:
            progress(d, report.states, report.edges)
        level = nxt
    report.frontier_left = len(level) if ok and report.depth == depth else 0
    report.seconds = time.perf_counter() - t0
    return report


def transition_name(transition: Hashable) -> str:
    """``STATE--event`` for a (state, event) transition, for reports."""
    if isinstance(transition, tuple) and len(transition) == 2:
        state, event = transition
        return f"{getattr(state, 'name', state)}--{getattr(event, 'value', event)}"
    return repr(transition)


def explore_main(
    argv: list[str] | None,
    description: str,
    configs: Collection[str],
    run: Callable[[str, int | None], ExploreReport],
    prog: str | None = None,
) -> int:
    """A command line over named configurations: ``[--config NAME]... [--depth N]``; exit 1
    if any configuration reports a violation. ``prog``: how usage names the command (the
    ``python -m`` line of a module; default: the script's name)."""
    ap = ArgParser(prog or os.path.basename(sys.argv[0]), description)
    ap.add_argument("--config", choices=sorted(configs), action="append", help="default: every configuration")
    ap.add_argument("--depth", type=positive_int, default=None, help="default: each configuration's own")
    args = ap.parse_args(argv)
    try:
        reports = [run(name, args.depth) for name in args.config or sorted(configs)]
        if len(reports) > 1:
            print(combined_summary(reports), flush=True)
    except BrokenPipeError:  # NOTE: piped into head: stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:  # NOTE: Ctrl-C: one line and 130, as every command of ours
        print("interrupted", file=sys.stderr)
        return 130
    return 1 if any(r.violations for r in reports) else 0


def check_run(name: object, depth: object, configs: Collection[str]) -> None:
    """The arguments of an explorer's ``run``: a configuration it has, a depth of at least 1
    (or None: the configuration's own); MisuseError otherwise (a depth of 0 explores nothing
    and would pass)."""
    if not isinstance(name, str) or name not in configs:
        raise MisuseError(f"no configuration {name!r}; choose from {', '.join(sorted(configs))}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise MisuseError(f"depth must be an int >= 1 (or None: the configuration's own), got {depth!r}")


def combined_summary(reports: Sequence[ExploreReport]) -> str:
    """One line over several explorations: states, violations, and the transitions they
    reach together (a configuration alone reaches only those its scope allows)."""
    universe: dict[str, frozenset[Hashable]] = {}
    covered: dict[str, set[Hashable]] = {}
    for r in reports:
        universe.update(r.universe)
        for model, seen in r.covered.items():
            covered.setdefault(model, set()).update(seen)
    cov = ", ".join(f"{m} {len(covered.get(m, set()) & u)}/{len(u)}" for m, u in sorted(universe.items()))
    return (
        f"[all {len(reports)} configurations] {sum(r.states for r in reports)} states, "
        f"{sum(len(r.violations) for r in reports)} violations, transitions together: {cov or 'none'}, "
        f"{sum(r.seconds for r in reports):.1f}s"
    )
