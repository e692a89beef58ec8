"""Exhaustive exploration of the real core at small scope, and that it is able to fail."""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterator

import pytest

from hicache.core.allocator import PageAllocator
from hicache.core.cache import CacheCore
from hicache.core.node import Node, Transfer
from hicache.core.tree import HiRadixTree
from hicache.spec.explorer import ExploreReport, explore
from hicache.spec.model import TABLE, Event, Tier
from hicache.testing.explore_core import CONFIGS, LRU, ORDERING, UNIVERSE, CoreSystem, run
from hicache.testing.fake_backend import FakeBackend


@pytest.mark.slow  # exhaustive search; CI runs it, the mutation run does not
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_interleaving_keeps_every_invariant_and_reaches_every_transition(name: str) -> None:
    """Breadth-first over every interleaving of prefill/insert/abort/start/complete/fail/
    cancel/evict to the configuration's depth: every check holds after every operation, and
    the transitions taken are exactly those the scope allows (all of TABLE when no tier has
    capacity 0), so coverage cannot quietly drop."""
    cfg = CONFIGS[name]
    report = run(name)
    print(f"\n[{name}] {report.summary()}")
    assert not report.violations, report.violations[0]
    expected = cfg.expected()
    assert set(expected) == set(UNIVERSE)
    for model, transitions in expected.items():
        covered = report.covered.get(model, set())
        assert covered == transitions, (model, sorted(transitions - covered, key=repr))
    if all(cfg.sizes.capacities):
        assert len(report.transitions) == len(TABLE) == 72
    if cfg.exhaustive:
        assert report.frontier_left == 0 and report.depth < cfg.depth, "the scope was not exhausted"


def _merged_pairs(system: CoreSystem, depth: int) -> Iterator[tuple[CoreSystem, CoreSystem]]:
    """Pairs of states reached by different traces that the explorer merges (equal keys)."""
    first: dict[Hashable, CoreSystem] = {system.key(): system}
    level = [system]
    for _ in range(depth):
        nxt = []
        for parent in level:
            for action in parent.actions():
                child = parent.clone()
                child.apply(action)
                k = child.key()
                if k in first:
                    yield first[k], child
                else:
                    first[k] = child
                    nxt.append(child)
        level = nxt


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ps1", "ps2"])
def test_states_with_equal_keys_behave_alike(name: str) -> None:
    """The key leaves out nothing that matters: two states merged by the explorer offer
    the same operations and keep equal keys and equal checks under the same random
    operations (a fixed seed; 300 merged pairs, 12 steps each)."""
    rng = random.Random(1)
    pairs = list(_merged_pairs(CONFIGS[name].system(), 7))
    assert len(pairs) > 300
    for a, b in rng.sample(pairs, 300):
        a, b = a.clone(), b.clone()
        for _ in range(12):
            actions = a.actions()
            assert actions == b.actions()
            if not actions:
                break
            action = rng.choice(actions)
            a.apply(action)
            b.apply(action)
            assert a.key() == b.key(), action
            assert a.check() == b.check()


def _first_violation(name: str, depth: int | None = None) -> tuple[list[str], str]:
    cfg = CONFIGS[name]
    report: ExploreReport = explore(cfg.system(), cfg.depth if depth is None else depth, universe=UNIVERSE)
    assert report.violations, "the planted bug went unnoticed"
    trace, violation = report.violations[0]
    return trace, violation.code


def test_explorer_catches_an_early_publish(monkeypatch: pytest.MonkeyPatch) -> None:
    """The explorer is able to fail: publish a copy before the bytes arrived."""
    real_submit = FakeBackend.submit

    def early_publish(self: FakeBackend, transfer: Transfer) -> None:
        real_submit(self, transfer)
        self.core.complete(transfer)  # published, bytes never copied

    monkeypatch.setattr(FakeBackend, "submit", early_publish)
    _, code = _first_violation("ps1", 4)
    assert code == ORDERING


def test_explorer_catches_a_failed_transfer_that_keeps_its_destination(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fail/cancel that does not give its private destination pages back is caught as a
    leak at the very operation (that state's key equals a state seen before)."""
    abandoning = [False]
    real_abandon = CacheCore._abandon
    real_free = PageAllocator.free

    def abandon(self: CacheCore, transfer: Transfer, event: Event) -> None:
        abandoning[0] = True
        try:
            real_abandon(self, transfer, event)
        finally:
            abandoning[0] = False

    def free(self: PageAllocator[int], pages: object) -> None:
        if not abandoning[0]:
            real_free(self, pages)  # type: ignore[arg-type]

    monkeypatch.setattr(CacheCore, "_abandon", abandon)
    monkeypatch.setattr(PageAllocator, "free", free)
    trace, code = _first_violation("ps1")
    assert code == "ownership.leaked"
    assert trace[-1].split(":")[0] in ("fail", "cancel"), trace


def test_explorer_catches_an_eviction_that_is_not_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eviction index that hands out the most recently used leaf is caught."""

    def pop_mru(self: HiRadixTree, tier: Tier) -> Node | None:
        leaves = [n for n in self.nodes.values() if self.is_evictable(n, tier)]
        return max(leaves, key=lambda n: n.stamp[tier], default=None)

    monkeypatch.setattr(HiRadixTree, "pop_lru", pop_mru)
    trace, code = _first_violation("ps1")
    assert code == LRU
    assert trace[-1].startswith("evict:"), trace
