"""HiRadixTree contracts the seed-26 mutation draw found unchecked: a refused transition
names the run it was refused on, and removing a run is traced under that run's id."""

from __future__ import annotations

import pytest

from hicache.core import CacheCore, TierSizes
from hicache.core.tree import TraceEntry
from hicache.errors import TransitionRefused
from hicache.spec.model import Event, RunState, Tier
from tests.core.test_tree import prefill


def test_a_refused_transition_names_the_run_or_a_private_run() -> None:
    """TransitionRefused says which event the spec refused and on what: the node's repr for
    a run in the tree, "a private run" for pages not in the tree yet; nothing changes."""
    core = CacheCore(2, TierSizes(8, 8, 8), tracing=True)
    node = prefill(core, (1, 2, 3, 4))  # state L1: removing it is refused
    before = core.snapshot()
    with pytest.raises(TransitionRefused) as info:
        core.tree.remove(node)
    assert str(info.value) == f"spec refuses 'remove' on {node!r}"
    assert repr(node).startswith(f"Node#{node.id}(")
    assert core.snapshot() == before
    with pytest.raises(TransitionRefused) as info:
        core.tree.expect(None, Event.DISCOVER)
    assert str(info.value) == "spec refuses 'discover' on a private run"


def test_removing_a_run_is_traced_under_its_id() -> None:
    """In tracing mode, evicting a run's last copy logs EMPTY --remove--> REMOVED under the
    run's node id (-1 is reserved for private runs)."""
    core = CacheCore(2, TierSizes(8, 8, 8), tracing=True)
    node = prefill(core, (1, 2, 3, 4))
    core.evict_node(node, Tier.L1)
    assert not node.alive
    removals = [e for e in core.tree.trace if e.event is Event.REMOVE]
    assert removals == [TraceEntry(node.id, RunState.EMPTY, Event.REMOVE, RunState.REMOVED)]
