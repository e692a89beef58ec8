"""CacheCore.can_lose / lose: only an unpinned L3 copy the spec lets go can be lost."""

from __future__ import annotations

import pytest

from hicache.core.node import Node
from hicache.errors import TransitionRefused
from hicache.spec.model import Direction, RunState, Tier
from tests.core.test_tree import make, prefill, through


def state(node: Node) -> RunState | None:
    """The run's state now (a call, so a type checker does not carry it across changes)."""
    return node.state


def test_a_run_without_an_l3_copy_cannot_be_lost() -> None:
    """can_lose is False for a live run with no L3 copy, and lose refuses it unchanged."""
    core = make()
    node = prefill(core, (1, 2))
    assert not core.can_lose(node)
    before = core.snapshot()
    with pytest.raises(TransitionRefused, match="cannot lose"):
        core.lose(node)
    assert core.snapshot() == before


def test_an_l3_copy_pinned_or_also_in_l2_cannot_be_lost() -> None:
    """An L3 copy can be lost only once it is neither pinned in L3 nor also held in L2."""
    core = make()
    prompt = (1, 2, 3, 4)
    node = prefill(core, prompt)
    through(core, node, Direction.D2H, Direction.H2S)
    core.evict(Tier.L1, 100)
    assert state(node) is RunState.L2_L3
    assert not core.can_lose(node)  # the spec keeps a run in L2 from losing its L3 copy
    core.evict(Tier.L2, 100)
    assert state(node) is RunState.L3
    lease = core.lock(core.match(prompt).l3)
    assert not core.can_lose(node)  # pinned in L3
    core.release(lease)
    assert core.can_lose(node)
    assert core.lose(node) == 2
