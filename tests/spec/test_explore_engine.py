"""The generic explorer on a toy system small enough to count by hand.

The toy is a counter 0..3: ``inc`` (below 3), ``dec`` and ``reset`` (above 0). Its key is
the count alone, so ``dec`` and ``reset`` lead back into states seen before::

    depth 1: 0 -inc-> 1                                   states 2, edges 1
    depth 2: 1 -inc-> 2, 1 -dec-> 0*, 1 -reset-> 0*       states 3, edges 4
    depth 3: 2 -inc-> 3, 2 -dec-> 1*, 2 -reset-> 0*       states 4, edges 7
    depth 4: 3 -dec-> 2*, 3 -reset-> 0*                   states 4, edges 9  (* seen)
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from enum import Enum

import pytest

from hicache.errors import MisuseError
from hicache.spec.explorer import Coverage, ExploreReport, explore, explore_main, transition_name
from hicache.spec.invariants import Violation
from hicache.spec.model import RunState

TAKEN = frozenset(
    {(0, "inc"), (1, "inc"), (1, "dec"), (1, "reset"), (2, "inc"), (2, "dec"), (2, "reset"), (3, "dec"), (3, "reset")}
)
UNIVERSE = {"toy": TAKEN | {(4, "dec")}}


class Toy:
    """The counter; ``bad`` is an (x before, action) edge its check reports."""

    def __init__(self, bad: tuple[int, str] | None = None) -> None:
        self.x = 0
        self.bad = bad
        self.last: tuple[int, str] | None = None
        self.taken: frozenset[tuple[int, str]] = frozenset()

    def actions(self) -> list[str]:
        return (["inc"] if self.x < 3 else []) + (["dec", "reset"] if self.x else [])

    def apply(self, action: str) -> None:
        self.last = (self.x, action)
        self.taken |= {self.last}
        self.x = {"inc": self.x + 1, "dec": self.x - 1, "reset": 0}[action]

    def clone(self) -> Toy:
        twin = Toy(self.bad)
        twin.x, twin.last, twin.taken = self.x, self.last, self.taken
        return twin

    def key(self) -> Hashable:
        return self.x

    def check(self) -> list[Violation]:
        if self.bad is not None and self.last == self.bad:
            return [Violation("toy", f"x={self.x}", "bad edge", "toy.bad")]
        return []

    def coverage(self) -> Coverage:
        return {"toy": self.taken}


def test_counts_states_edges_and_the_coverage_of_every_edge() -> None:
    """Exhausted at depth 4: 4 states, 9 edges; every edge's transition is covered, also
    those into states seen before; the one unreachable transition is reported missing."""
    levels: list[tuple[int, int, int]] = []
    report = explore(Toy(), 10, universe=UNIVERSE, progress=lambda d, s, e: levels.append((d, s, e)))
    assert (report.states, report.edges, report.depth, report.frontier_left) == (4, 9, 4, 0)
    assert levels == [(1, 2, 1), (2, 3, 4), (3, 4, 7), (4, 4, 9)]
    assert report.covered == {"toy": TAKEN} and report.missing("toy") == {(4, "dec")}
    assert not report.violations
    summary = report.summary()
    assert summary.startswith("4 states, 9 edges, depth 4, transitions toy 9/10, 0 violations")


def test_stops_at_the_depth_and_counts_the_unexpanded_frontier() -> None:
    """At depth 2 the state reached last (x = 2) is left unexpanded."""
    report = explore(Toy(), 2, universe=UNIVERSE)
    assert (report.states, report.edges, report.depth, report.frontier_left) == (3, 4, 2, 1)
    assert report.transitions == set()  # no "run" model in the toy


def test_stops_at_max_states() -> None:
    """``max_states`` bounds the states kept, mid-level."""
    report = explore(Toy(), 10, max_states=3)
    assert report.states == 3 and report.depth == 2


def test_checks_an_edge_into_a_state_seen_before() -> None:
    """A violation on an edge whose target was already seen (2 -reset-> 0) is reported
    with the trace that reached it, and exploration stops there (x = 3, reached on the
    same level, is never expanded)."""
    report = explore(Toy(bad=(2, "reset")), 10)
    assert len(report.violations) == 1
    trace, violation = report.violations[0]
    assert trace == ["inc", "inc", "reset"] and violation.code == "toy.bad"
    assert (report.states, report.edges, report.depth, report.frontier_left) == (4, 7, 3, 0)


def test_checks_the_initial_state() -> None:
    """A violation in the initial state is reported with an empty trace, nothing expanded."""
    toy = Toy(bad=(0, "start"))
    toy.last = (0, "start")
    report = explore(toy, 10)
    assert report.violations[0][0] == [] and report.edges == 0 and report.states == 1


def test_report_covers_models_with_and_without_a_universe() -> None:
    """A model with a universe but no coverage misses all of it; the summary lists every
    model, covered or declared, with a ratio only where a universe is known, and says
    ``none`` when there is no model at all."""
    report = ExploreReport(
        states=3, edges=2, depth=1, covered={"seen": {1, 2}}, universe={"toy": frozenset({(0, "inc"), (1, "dec")})}
    )
    assert report.missing("toy") == {(0, "inc"), (1, "dec")}
    assert report.missing("seen") == set()
    assert report.summary() == "3 states, 2 edges, depth 1, transitions seen 2, toy 0/2, 0 violations, 0.0s"
    assert ExploreReport().summary() == "0 states, 0 edges, depth 0, transitions none, 0 violations, 0.0s"


class _Go(Enum):
    """An event whose ``str`` is not its value."""

    GO = "go"


@pytest.mark.parametrize(
    ("transition", "name"),
    [
        ((RunState.L1_L2, _Go.GO), "L1_L2--go"),
        ((0, "inc"), "0--inc"),
        ((0, "inc", 1), "(0, 'inc', 1)"),
        ("ab", "'ab'"),
        (7, "7"),
    ],
)
def test_transition_name_spells_a_state_event_pair(transition: Hashable, name: str) -> None:
    """A (state, event) pair reads ``STATE--event``: the state's enum name and the event's
    value, or the plain values when they are not enums; anything else reads as its repr."""
    assert transition_name(transition) == name


class _Runs:
    """A stand-in for a configuration runner: records each call, fails the named ones."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.failing = failing

    def __call__(self, name: str, depth: int | None) -> ExploreReport:
        self.calls.append((name, depth))
        bad = [([f"step {name}"], Violation("toy", name, "planted", "toy.planted"))]
        return ExploreReport(violations=bad if name in self.failing else [])


def test_explore_main_runs_every_configuration_at_its_own_depth_by_default() -> None:
    """With no arguments every configuration runs once, in name order, with no depth
    override, and a clean run exits 0."""
    runs = _Runs()
    assert explore_main([], "toy", {"b", "a", "c"}, runs) == 0
    assert runs.calls == [("a", None), ("b", None), ("c", None)]


def test_explore_main_runs_the_named_configurations_at_the_given_depth() -> None:
    """Repeated ``--config`` runs exactly those, in the order given, at ``--depth``."""
    runs = _Runs()
    assert explore_main(["--config", "c", "--config", "a", "--depth", "3"], "toy", {"a", "b", "c"}, runs) == 0
    assert runs.calls == [("c", 3), ("a", 3)]


def test_explore_main_exits_1_when_any_configuration_reports_a_violation() -> None:
    """One failing configuration makes the exit status 1, and the others still run."""
    runs = _Runs(failing=frozenset({"a"}))
    assert explore_main([], "toy", {"a", "b"}, runs) == 1
    assert runs.calls == [("a", None), ("b", None)]


def test_explore_main_refuses_an_unknown_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown ``--config`` is a usage error (exit 2) naming the choices; nothing runs."""
    runs = _Runs()
    with pytest.raises(SystemExit) as exit_:
        explore_main(["--config", "zz"], "toy", {"a", "b"}, runs)
    assert exit_.value.code == 2 and runs.calls == []
    assert capsys.readouterr().err == "error: --config zz: invalid choice (choose from a, b)\n"


@pytest.mark.parametrize(
    ("depth", "reason"), [("0", "must be an integer >= 1"), ("-inf", "not an integer"), ("x", "not an integer")]
)
def test_explore_main_refuses_a_bad_depth(depth: str, reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A depth below 1 or not an integer is one error line (exit 2); nothing runs."""
    runs = _Runs()
    with pytest.raises(SystemExit) as exit_:
        explore_main(["--depth", depth], "toy", {"a", "b"}, runs)
    assert exit_.value.code == 2 and runs.calls == []
    assert capsys.readouterr().err == f"error: --depth {depth}: {reason}\n"


def test_explore_main_help_documents_the_options(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--help`` exits 0 and shows the description, the choices and what ``--depth``
    defaults to."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_:
        explore_main(["--help"], "Explore the toy.", {"a", "b"}, _Runs())
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Explore the toy." in text and "{a,b}" in text
    assert "--depth N default: each configuration's own" in text


@pytest.mark.parametrize("module", ["explore_core", "explore_requests"])
def test_the_explorers_usage_names_their_module(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Run as ``python -m``, usage names that command, not the file (``explore_core.py``)."""
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(f"hicache.testing.{module}").main(["--help"])
    assert capsys.readouterr().out.startswith(f"usage: python -m hicache.testing.{module} ")


def test_several_configurations_end_with_what_they_reach_together(capsys: pytest.CaptureFixture[str]) -> None:
    """Each configuration reaches only what its scope allows; the last line sums the states
    and violations and counts a transition once however many configurations reach it."""
    universe: dict[str, frozenset[Hashable]] = {
        "run": frozenset({"t1", "t2", "t3"}),
        "request": frozenset({"r1", "r2"}),
    }
    reports = {
        "a": ExploreReport(states=5, seconds=1.0, universe=universe, covered={"run": {"t1", "t2"}}),
        "b": ExploreReport(states=7, seconds=2.0, universe=universe, covered={"run": {"t2"}, "request": {"r1"}}),
    }
    reports["b"].violations.append((["x"], Violation("toy", "b", "planted", "toy.planted")))
    assert explore_main([], "toy", set(reports), lambda name, depth: reports[name]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "[all 2 configurations] 12 states, 1 violations, transitions together: request 1/2, run 2/3, 3.0s"
    )


def test_one_configuration_prints_no_combined_line(capsys: pytest.CaptureFixture[str]) -> None:
    """With one configuration its own summary is the last word."""
    assert explore_main(["--config", "a"], "toy", {"a", "b"}, _Runs()) == 0
    assert "[all" not in capsys.readouterr().out


@pytest.mark.parametrize("module", ["explore_core", "explore_requests"])
@pytest.mark.parametrize(
    ("name", "depth", "says"),
    [
        ("nope", None, "no configuration 'nope'; choose from "),
        (None, None, "no configuration None"),
        ("first", 0, "depth must be an int >= 1"),
        ("first", -3, "depth must be an int >= 1"),
        ("first", 2.5, "got 2.5"),
        ("first", "2", "got '2'"),
        ("first", True, "got True"),
    ],
)
def test_an_explorers_run_refuses_what_would_explore_nothing(
    module: str, name: object, depth: object, says: str
) -> None:
    """From Python as from the command line: an unknown configuration or a depth below 1 is
    refused (depth 0 explored one state and passed)."""
    import importlib

    explorer = importlib.import_module(f"hicache.testing.{module}")
    if name == "first":
        name = sorted(explorer.CONFIGS)[0]
    with pytest.raises(MisuseError, match=re.escape(says)):
        explorer.run(name, depth)


def test_an_explorer_piped_into_head_stops_without_a_traceback() -> None:
    """``... | head`` closes the pipe early: the explorer stops quietly (status 141, as a
    shell tool killed by SIGPIPE). Here the pipe is closed before it starts: its first
    line already finds no reader."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        cmd = [sys.executable, "-m", "hicache.testing.explore_core", "--config", "ps1", "--depth", "2"]
        done = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, timeout=300, check=False)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, b"")


def test_explore_main_answers_ctrl_c_with_one_line_and_130(capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while a configuration is explored: ``interrupted`` and 130, no traceback."""

    def interrupted(name: str, depth: int | None) -> ExploreReport:
        raise KeyboardInterrupt

    assert explore_main([], "toy", {"a"}, interrupted) == 130
    assert capsys.readouterr().err == "interrupted\n"
