"""check_integrity() names each invariant of DESIGN.md §4 when it is broken on purpose."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hicache.core import CacheCore, DevicePage, TierSizes
from hicache.core.node import Node
from hicache.errors import IntegrityError
from hicache.spec.model import Direction, Tier


def build() -> tuple[CacheCore, Node, Node]:
    """A healthy cache: (1,2,3,4) in L1+L2 split into [1,2] -> [3,4] and [1,2] -> [5,6]."""
    core = CacheCore(2, TierSizes(8, 8, 8))
    pages = core.allocate_l1(2)
    assert pages is not None
    a = core.insert((1, 2, 3, 4), pages).node
    x = core.start(Direction.D2H, a)
    assert x is not None
    core.complete(x)
    more = core.allocate_l1(1)
    assert more is not None
    b = core.insert((1, 2, 5, 6), [pages[0], *more]).node
    core.check_integrity()
    return core, a, b


def leak_private(core: CacheCore, a: Node, b: Node) -> None:
    core.private.add(7)  # L1 page 7 is free *and* claimed by a request


def lose_page(core: CacheCore, a: Node, b: Node) -> None:
    pages = core.allocate_l1(1)  # allocated, then forgotten: nobody owns it
    assert pages is not None
    core.private.discard(pages[0])


def bad_refs(core: CacheCore, a: Node, b: Node) -> None:
    a.refs[Tier.L1] = 1  # no lease holds it


def bad_counter(core: CacheCore, a: Node, b: Node) -> None:
    core.tree.evictable[Tier.L2] += 1


def missing_from_index(core: CacheCore, a: Node, b: Node) -> None:
    core.tree._heaps[Tier.L1].clear()


def break_closure(core: CacheCore, a: Node, b: Node) -> None:
    assert b.parent is not None
    pages = core.l3.allocate(1)
    assert pages is not None
    b.pages[Tier.L3] = list(pages)  # child has L3, its parent [1,2] does not
    b.parent.tier_children[Tier.L3] += 1
    core.tree.evictable[Tier.L3] += 1
    core.tree.push_candidate(b, Tier.L3)


def misalign(core: CacheCore, a: Node, b: Node) -> None:
    b.key = (*b.key, 7)


def wrong_parent(core: CacheCore, a: Node, b: Node) -> None:
    b.parent = a


def hollow_node(core: CacheCore, a: Node, b: Node) -> None:
    pages = b.pages[Tier.L1]
    assert pages is not None
    b.pages[Tier.L1] = None
    assert b.parent is not None
    b.parent.tier_children[Tier.L1] -= 1
    core.tree.evictable[Tier.L1] -= len(pages)
    core.l1.free([DevicePage(p) for p in pages])


def duplicate_page(core: CacheCore, a: Node, b: Node) -> None:
    pa, pb = a.pages[Tier.L1], b.pages[Tier.L1]
    assert pa is not None and pb is not None
    core.l1.free([DevicePage(p) for p in pb])
    b.pages[Tier.L1] = list(pa)  # the same physical page in two nodes


def undeclared_state(core: CacheCore, a: Node, b: Node) -> None:
    x = core.start(Direction.D2H, b)
    assert x is not None
    a.inflight[Direction.S2H] = x  # L1+L2 with S2H "in flight": not a declared point
    a.pending[Direction.S2H] = [0]


BREAKS: dict[str, tuple[Callable[[CacheCore, Node, Node], None], str]] = {
    "double-owned page": (leak_private, "ownership"),
    "leaked page": (lose_page, "ownership"),
    "refs without a lease": (bad_refs, "pinning"),
    "wrong evictable counter": (bad_counter, "pinning"),
    "evictable leaf not indexed": (missing_from_index, "pinning"),
    "copy without parent copy": (break_closure, "prefix-closure"),
    "node length not page aligned": (misalign, "alignment"),
    "parent pointer disagrees": (wrong_parent, "structure"),
    "node that holds nothing": (hollow_node, "structure"),
    "page in two nodes": (duplicate_page, "uniqueness"),
    "undeclared (R, F)": (undeclared_state, "declared-states"),
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_check_integrity_names_the_broken_invariant(case: str) -> None:
    core, a, b = build()
    breaker, invariant = BREAKS[case]
    breaker(core, a, b)
    with pytest.raises(IntegrityError) as info:
        core.check_integrity()
    assert info.value.invariant == invariant, str(info.value)
    assert "this is a bug" in str(info.value)


def test_tracing_catches_a_change_the_spec_did_not_declare(monkeypatch: pytest.MonkeyPatch) -> None:
    """In tracing mode, a mutation that lands elsewhere than the spec's target is caught."""
    core = CacheCore(2, TierSizes(8, 8, 8), tracing=True)
    pages = core.allocate_l1(1)
    assert pages is not None
    node = core.insert((1, 2), pages).node
    x = core.start(Direction.D2H, node)
    assert x is not None
    publish = core.tree.publish

    def buggy_publish(n: Node, tier: Tier, p: list[int]) -> None:
        publish(n, Tier.L3, p)  # a bug: the copy lands in the wrong tier

    monkeypatch.setattr(core.tree, "publish", buggy_publish)
    with pytest.raises(IntegrityError) as info:
        core.complete(x)
    assert info.value.invariant == "declared-states"
    assert "D2H_PENDING --complete_d2h--> " in info.value.detail and "the spec says L1_L2" in info.value.detail
