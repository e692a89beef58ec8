"""A node's repr names its run state, or the undeclared ``(R, F)`` code it holds."""

from __future__ import annotations

from hicache.core.node import Lease, Node, Transfer
from hicache.spec.model import Direction, RunState, Tier


def test_repr_names_the_declared_state_or_the_undeclared_code() -> None:
    """A declared point shows its state's name; a D2H in flight with no copy (code 8) is
    not declared and shows as ``undeclared:8``."""
    node = Node(7, (1, 2, 3, 4), None)
    node.pages[Tier.L1] = [5]
    node.pages[Tier.L3] = [0]
    assert node.state is RunState.L1_L3
    assert repr(node) == "Node#7(len=4, L1_L3)"
    hollow = Node(9, (1, 2), None)
    lease = Lease(1, Tier.L1, hollow, 2)
    hollow.inflight[Direction.D2H] = Transfer(3, Direction.D2H, [hollow], [5], [6], lease, None, 2)
    assert hollow.state is None
    assert repr(hollow) == "Node#9(len=2, undeclared:8)"
