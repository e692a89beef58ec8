"""Invariant reports the seed-27 mutation draw found checked for the first direction only:
a node's later directions are checked too."""

from __future__ import annotations

import pytest

from hicache.spec import invariants
from hicache.spec.model import Direction, Tier
from tests.spec.test_invariants import _free_page, _node, _set, base


@pytest.mark.parametrize("direction", [Direction.H2S, Direction.S2H, Direction.H2D], ids=lambda d: d.name)
def test_pending_pages_without_a_transfer_are_found_in_every_direction(direction: Direction) -> None:
    """Pending pages without a transfer in a direction after D2H (where the node has
    nothing in flight) are reported, naming that direction: the check does not stop at the
    first direction with no transfer."""
    b = base()
    n = b.snap.nodes[b.c]
    assert all(x is None for x in n.inflight)
    tier = Tier.L1 if direction is Direction.H2D else (Tier.L3 if direction is Direction.H2S else Tier.L2)
    snap = _node(b.snap, b.c, pending=_set(n.pending, direction, (_free_page(b.snap, tier),)))
    found = [v for v in invariants.declared_states(snap) if v.code == "declared-states.pending-without-transfer"]
    assert [v.detail for v in found] == [f"pending {direction.name} pages without a transfer"]
    assert found[0].where == f"node #{b.c}"
