"""Exhaustive exploration of the real core at small scope (page sizes 1 and 2)."""

from __future__ import annotations

import pytest

from hicache.spec.explorer import explore
from hicache.testing.explore_core import CONFIGS, CoreSystem

# Depth chosen so both configurations finish in well under a minute on a CI machine;
# `python -m hicache.testing.explore_core --depth 14` goes deeper (about 100k states).
DEPTH = {"ps1": 11, "ps2": 12}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_interleaving_keeps_every_invariant(name: str) -> None:
    """Breadth-first over every interleaving of prefill/insert/abort/start/complete/fail/
    cancel/evict to DEPTH operations: every invariant holds in every state reached."""
    ps, sizes, seqs = CONFIGS[name]
    report = explore(CoreSystem(ps, sizes, seqs), DEPTH[name])
    print(f"\n[{name}] page size {ps}, capacities {sizes.capacities}, sequences {seqs}: {report.summary()}")
    assert not report.violations, report.violations[0]
    assert report.states > 1000 and len(report.transitions) >= 40


def test_explorer_finds_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """The explorer is able to fail: publish a D2H copy before the bytes arrived."""
    from hicache.testing.fake_backend import FakeBackend

    real_submit = FakeBackend.submit

    def early_publish(self: FakeBackend, transfer: object) -> None:
        real_submit(self, transfer)  # type: ignore[arg-type]
        self.core.complete(transfer)  # type: ignore[arg-type]  # published, bytes never copied

    monkeypatch.setattr(FakeBackend, "submit", early_publish)
    ps, sizes, seqs = CONFIGS["ps1"]
    report = explore(CoreSystem(ps, sizes, seqs), 4)
    assert report.violations and report.violations[0][1].invariant == "ordering"
