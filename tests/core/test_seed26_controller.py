"""Controller contracts the seed-26 mutation draw found unchecked: request numbering, which
stores are asked what they hold, the recompute and fallback counters, withdrawing a restore
on release, following a given plan, a promotion with no L1 room, and close with a backup
already running. The movers hold every copy until told (hicache.testing.tag_movers)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from hicache.core.cache import CacheCore
from hicache.core.controller import Controller
from hicache.core.cost import CostModel, CostPriors
from hicache.core.geometry import TierSizes
from hicache.errors import HandleError
from hicache.spec.model import Direction, Tier
from hicache.spec.request import ReqState
from hicache.testing.tag_movers import TagDevice, TagFabric, TagStorage

PS = 2  # tokens per page


class _PrivateKeyedStore(TagStorage):
    """A keyed store only this cache writes (not shared) that claims to hold every page."""

    def __init__(self, fabric: TagFabric) -> None:
        super().__init__(fabric)
        self.asked: list[int] = []

    @property
    def keyed(self) -> bool:
        return True

    def exists(self, keys: Sequence[bytes]) -> int:
        self.asked.append(len(keys))
        return len(keys)


def _make(l1: int = 8, l2: int = 8, l3: int = 16, *, storage: TagStorage | None = None) -> tuple[Controller, TagFabric]:
    sizes = TierSizes(l1, l2, l3)
    fabric = TagFabric(sizes.capacities)
    store = TagStorage(fabric) if storage is None else storage
    seed = b"model" if store.keyed else None
    core = CacheCore(PS, sizes, tracing=True)
    c = Controller(core, TagDevice(fabric), store, CostModel(1, CostPriors(), "always"), key_seed=seed)
    return c, fabric


def _cached(c: Controller, tokens: list[int], *drop: Tier) -> None:
    """Prefill ``tokens``, back them up through every tier, release, drop the given tiers."""
    req = c.admit(tokens)
    pages = c.allocate(req, len(tokens) // PS - req.cached_len // PS)
    assert pages is not None
    c.insert(req, pages)
    c.release(req)
    c.drain()
    for tier in drop:
        c.core.evict(tier, 10**6)


def test_requests_are_numbered_from_one_in_admission_order() -> None:
    """A fresh controller numbers its requests 1, 2, 3, ... as admitted, and a refusal names
    that number (docs/RELIABILITY.md: releasing the first request twice names ``#1``)."""
    c, _ = _make()
    reqs = [c.admit([i, i]) for i in range(3)]
    assert [r.id for r in reqs] == [1, 2, 3]
    c.release(reqs[0])
    with pytest.raises(HandleError, match=r"^release: request #1 was released; release it once$"):
        c.release(reqs[0])
    c.close()


def test_a_private_keyed_store_is_never_asked_what_it_holds() -> None:
    """Only a shared store gains pages behind the cache's back: a keyed store this cache
    alone writes is never asked ``exists``, and a miss stays a miss in every tier."""
    store = _PrivateKeyedStore(TagFabric(TierSizes(8, 8, 16).capacities))
    c, _ = _make(storage=store)
    req = c.admit(list(range(8)))
    assert req.hit == (0, 0, 0) and store.asked == []
    c.release(req)
    c.close()


def test_recomputed_tokens_counts_each_insert_past_its_cached_prefix() -> None:
    """Each insert adds the aligned tokens the request computed beyond its cached prefix:
    4 for a 5-token prompt on an empty cache, then 4 more for an 8-token prompt whose first
    4 tokens were cached."""
    c, _ = _make()
    _cached(c, [1, 2, 3, 4, 5])
    assert c.metrics.recomputed_tokens == 4
    req = c.admit([1, 2, 3, 4, 6, 7, 8, 9])
    assert req.cached_len == 4
    pages = c.allocate(req, 2)
    assert pages is not None
    assert c.insert(req, pages) == 8
    assert c.metrics.recomputed_tokens == 8
    c.release(req)
    c.close()


def test_releasing_a_request_withdraws_its_restore_copy_not_yet_started() -> None:
    """Released while its H2D is still queued, a restore ends cancelled, saying why; the
    copy is withdrawn from the mover and nothing stays pending."""
    c, fabric = _make()
    tokens = list(range(6))
    _cached(c, tokens, Tier.L1)
    req = c.admit(tokens)
    pending = c.start_restore(req)
    assert pending is not None and pending.stage == "h2d" and len(fabric.queue) == 1
    c.release(req)
    assert (pending.stage, pending.error) == ("cancelled", "released before its copy started")
    assert fabric.queue == [] and c.status().pending_restores == 0
    c.check_integrity()
    c.close()


def test_each_restore_the_mover_cannot_issue_is_one_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore whose copy the device mover refuses to issue does not start: start_restore
    returns None, the request is ready to prefill, and ``fallbacks`` counts exactly one per
    such restore."""
    c, _ = _make()
    tokens = list(range(6))
    _cached(c, tokens, Tier.L1)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no copy engine")

    monkeypatch.setattr(c.device, "h2d", refuse)
    for _ in range(2):
        req = c.admit(tokens)
        assert c.start_restore(req) is None
        assert req.state is ReqState.READY and req.restore is None and req.cached_len == 0
        c.release(req)
    assert c.metrics.fallbacks == 2
    assert c.metrics.directions[Direction.H2D.name].failed == 2
    c.check_integrity()
    c.close()


def test_a_blocking_restore_follows_the_plan_it_is_given() -> None:
    """``restore(req, plan)`` restores exactly ``plan.tokens``, not what :meth:`plan` would
    choose (here a shorter prefix than the whole L2 hit)."""
    c, _ = _make()
    tokens = list(range(6))
    _cached(c, tokens, Tier.L1)
    req = c.admit(tokens)
    plan = c.plan(req)
    assert (plan.tier, plan.tokens) == (Tier.L2, 6)
    assert c.restore(req, dataclasses.replace(plan, tokens=2))
    assert req.cached_len == 2 and len(c.prefix_pages(req)) == 1
    c.release(req)
    c.check_integrity()
    c.close()


def test_a_promotion_with_no_l1_room_for_its_load_fails_naming_why() -> None:
    """An L3 restore whose S2H lands while every L1 page is held privately cannot issue its
    H2D: it fails with that reason, counts one fallback, and the request recomputes."""
    c, _ = _make(l1=4, l2=4, l3=8)
    tokens = [1, 2, 3, 4]
    _cached(c, tokens, Tier.L1, Tier.L2)
    req = c.admit(tokens)
    assert req.hit == (0, 0, 4)
    pending = c.start_restore(req)
    assert pending is not None and pending.stage == "s2h"
    other = c.admit(list(range(100, 108)))
    assert c.allocate(other, 4) is not None  # all of L1, private to the other request
    c.drain()
    assert (pending.stage, pending.error) == ("failed", "no L1 room for the H2D after promotion")
    assert c.metrics.fallbacks == 1 and req.state is ReqState.READY and req.cached_len == 0
    assert c.core.match(tokens).lengths[1] == 4  # the promoted copy stays in L2
    c.release(other)
    c.release(req)
    c.check_integrity()
    c.close()


def test_close_lets_a_backup_copy_already_running_land() -> None:
    """close withdraws only backups whose copy has not started: a D2H already running is
    waited for and completes (counted as one completed D2H, none failed)."""
    c, fabric = _make()
    req = c.admit([1, 2, 3, 4])
    pages = c.allocate(req, 2)
    assert pages is not None
    c.insert(req, pages)
    assert [t.direction for t in fabric.queue] == [Direction.D2H]
    fabric.queue[0].begun = True
    c.close()
    d2h = c.metrics.directions[Direction.D2H.name]
    assert (d2h.count, d2h.failed) == (1, 0)
