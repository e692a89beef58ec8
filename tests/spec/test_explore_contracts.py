"""Explorer bounds on a system whose levels hold several states: ``max_states`` is never
exceeded and exploration stops at the first violation, not at the end of the level.

The system appends ``a`` or ``b`` to a word up to length 3; the key is the word, so every
level doubles: depth 1 adds 2 states, depth 2 adds 4."""

from __future__ import annotations

from collections.abc import Hashable

from hicache.spec.explorer import Coverage, explore
from hicache.spec.invariants import Violation


class Words:
    """Words over {a, b}; ``bad`` words are reported by the check."""

    def __init__(self, bad: frozenset[str] = frozenset()) -> None:
        self.word = ""
        self.bad = bad

    def actions(self) -> list[str]:
        return ["a", "b"] if len(self.word) < 3 else []

    def apply(self, action: str) -> None:
        self.word += action

    def clone(self) -> Words:
        twin = Words(self.bad)
        twin.word = self.word
        return twin

    def key(self) -> Hashable:
        return self.word

    def check(self) -> list[Violation]:
        return [Violation("words", self.word, "bad word", "words.bad")] if self.word in self.bad else []

    def coverage(self) -> Coverage:
        return {}


def test_max_states_is_never_exceeded_when_a_level_has_more_states_to_expand() -> None:
    """Hitting ``max_states`` while expanding the first of two states of a level stops the
    whole level: exactly ``max_states`` states, one edge past the last level."""
    report = explore(Words(), 10, max_states=4)
    assert (report.states, report.edges, report.depth) == (4, 3, 2)


def test_exploration_stops_at_the_first_violation_of_a_level() -> None:
    """Two bad words on one level: only the first found is reported, and the states of the
    level after it are never visited."""
    report = explore(Words(bad=frozenset({"ab", "bb"})), 10)
    assert [trace for trace, _ in report.violations] == [["a", "b"]]
    assert (report.states, report.edges) == (4, 4)
