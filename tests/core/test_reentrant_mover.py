"""A device mover that calls back into the cache while the cache waits for it (an embedder's
mover that releases a request from inside ``d2h``): under write_back ``allocate`` backs up an
L1 victim and waits for the copy before it takes pages; if the request was released meanwhile,
no page is handed to it (nothing leaks) and the caller hears why."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from hicache.core.cache import CacheCore
from hicache.core.controller import Controller
from hicache.core.cost import CostModel, CostPriors
from hicache.core.geometry import TierSizes
from hicache.errors import HandleError
from hicache.spec.model import Tier
from hicache.testing.tag_movers import TagDevice, TagFabric, TagTicket

PS = 2


class _CallingBack(TagDevice):
    """Runs ``hook`` (once) inside the next D2H it issues."""

    hook: Callable[[], None] | None = None

    def d2h(self, src: Sequence[int], dst: Sequence[int]) -> TagTicket:
        ticket = super().d2h(src, dst)
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return ticket


def test_a_request_released_by_the_mover_while_room_is_made_gets_no_pages() -> None:
    sizes = TierSizes(4, 16, 0)
    fabric = TagFabric(sizes.capacities)
    dev = _CallingBack(fabric)
    c = Controller(CacheCore(PS, sizes), dev, None, CostModel(1, CostPriors(), "always"), write_policy="write_back")
    first = c.admit([1, 2, 3, 4, 5, 6, 7, 8])
    pages = c.allocate(first, 4)
    assert pages is not None
    c.insert(first, pages)
    c.release(first)  # L1 full of a prefix with no L2 copy (write_back)
    assert c.core.l1.num_free == 0
    second = c.admit([9, 10, 11, 12])
    dev.hook = lambda: c.release(second)
    with pytest.raises(HandleError, match=f"request #{second.id} was released"):
        c.allocate(second, 2)
    c.drain()
    c.check_integrity()
    assert second.private == []
    c.core.evict(Tier.L1, 10**9)  # every L1 page the tree holds: all four are free again
    assert c.core.l1.num_free == 4
