"""Controller contracts an engine relies on: what plan/restore/poll return, which metrics
count, which errors name what, and how restores of released requests end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hicache import HiCache
from hicache.core.controller import Controller, PendingRestore, Request, check_selective_hits
from hicache.core.cost import Plan
from hicache.core.keys import format_seed, page_keys
from hicache.errors import ConfigError, IntegrityError, MisuseError
from hicache.spec.model import Tier
from tests.core.test_controller import cached, evict_all, make
from tests.core.test_shared_store import MODEL, compute
from tests.core.test_shared_store import G as KEYED_G
from tests.core.test_shared_store import make as make_keyed


def _synchronous(monkeypatch: pytest.MonkeyPatch, mover: object, name: str) -> None:
    """Make ``mover.name`` finish its copy before returning the ticket: the copy has run,
    so a release can no longer withdraw it."""
    issue: Callable[..., Any] = getattr(mover, name)

    def issued(*args: Any, **kwargs: Any) -> Any:
        ticket = issue(*args, **kwargs)
        ticket.wait()
        return ticket

    monkeypatch.setattr(mover, name, issued)


def _finish(c: HiCache, pending: PendingRestore) -> None:
    for _ in range(100):
        if pending.finished:
            return
        c.poll()
    raise AssertionError("the restore never finished")


def test_a_keyed_store_without_a_key_seed_is_refused_by_name() -> None:
    """A keyed L3 store needs the model's key seed: without one the controller refuses to
    be built, saying so."""
    c, _store = make_keyed()
    assert c.storage is not None and c.storage.keyed
    with pytest.raises(ConfigError, match=r"^a keyed L3 store needs the pages' key seed \(the model's identity\)$"):
        Controller(c.core, c.device, c.storage, c.controller.cost, key_seed=None)
    c.close()


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_a_bad_selective_hits_is_refused_naming_the_value(value: object) -> None:
    """selective_hits must be an int >= 1; the error repeats the value given."""
    with pytest.raises(ConfigError, match=rf"^selective_hits must be an int >= 1, got {value!r}$"):
        check_selective_hits(value)
    c = make()
    with pytest.raises(ConfigError, match=rf"^selective_hits must be an int >= 1, got {value!r}$"):
        Controller(c.core, c.device, c.storage, c.controller.cost, selective_hits=value)  # type: ignore[arg-type]
    c.close()


def test_policy_skips_counts_only_plans_that_pass_over_a_longer_hit() -> None:
    """A plan to recompute counts as a policy skip only when L2 or L3 held more than L1:
    not for a prompt nobody has seen, nor for one L1 holds as far as any tier."""
    c = make()
    tokens = list(range(8))
    fresh = c.admit([50] * 8)
    assert c.plan(fresh).tier is Tier.L1 and c.metrics.policy_skips == 0
    c.release(fresh)
    cached(c, tokens)
    req = c.admit(tokens)
    assert req.hit == (8, 8, 8)
    assert c.plan(req).tier is Tier.L1 and c.metrics.policy_skips == 0
    c.release(req)
    c.close()


def test_restore_with_nothing_to_restore_returns_false() -> None:
    """The blocking restore says False when there is nothing to restore, and the request
    is ready to prefill from zero."""
    c = make()
    req = c.admit(list(range(8)))
    assert c.restore(req) is False and req.cached_len == 0
    pages = c.allocate(req, 4)
    assert pages is not None and c.insert(req, pages) == 8
    c.release(req)
    c.close()


def test_an_l3_plan_reads_l2_when_the_run_was_promoted_meanwhile() -> None:
    """A plan made while a run was only in L3, committed after another request promoted it
    to L2, reads L2 (an H2D, no second promotion) and succeeds."""
    c = make()
    tokens = list(range(8))
    kv = cached(c, tokens, Tier.L1, Tier.L2)
    a = c.admit(tokens)
    plan = c.plan(a)
    assert plan.tier is Tier.L3 and plan.tokens == 8
    b = c.admit(tokens)
    assert c.restore(b) and c.metrics.promotions == 1
    c.release(b)
    evict_all(c, Tier.L1)
    assert c.core.match(tokens).lengths == (0, 8, 8)
    pending = c.start_restore(a, plan)
    assert pending is not None and pending.stage == "h2d"
    _finish(c, pending)
    assert pending.stage == "done" and a.cached_len == 8
    assert c.metrics.fallbacks == 0 and c.metrics.promotions == 1
    assert bool((c.l1.buffer[:, :, c.prefix_pages(a)] == kv).all())
    c.release(a)
    c.check_integrity()
    c.close()


def test_promotions_accumulate_over_restores() -> None:
    """metrics.promotions counts every run promoted from L3 to L2, across restores."""
    c = make()
    runs = [list(range(4)), [70] * 4, [80] * 4]
    for toks in runs:
        cached(c, toks)
    evict_all(c, Tier.L1, Tier.L2)
    for i, toks in enumerate(runs, 1):
        req = c.admit(toks)
        assert c.restore(req)
        assert c.metrics.promotions == i
        c.release(req)
    c.check_integrity()
    c.close()


def test_wrong_layer_events_are_refused_before_room_is_made() -> None:
    """``layer_events`` whose count is neither 0 nor the number of layers, or that are no
    events, are refused with a MisuseError before anything changes: the mover refused a
    wrong count only after the restore had evicted L1 copies to make room, and took ints
    of the right count, failing the copy into a fallback."""
    import torch

    from hicache import HiCacheConfig
    from hicache.core.geometry import KVGeometry

    g = KVGeometry(2, 1, 4, 4, torch.float32)
    cache = HiCache(HiCacheConfig(g, l1_pages=4, l2_pages=16, device="cpu", policy="always"))

    def serve(prompt: list[int]) -> None:
        req = cache.admit(prompt)
        pages = cache.allocate(req, -(-len(prompt) // 4))
        assert pages is not None
        cache.l1.buffer[:, :, pages] = float(prompt[0] + 1)
        cache.insert(req, pages[: len(prompt) // 4])
        cache.release(req)
        cache.drain()

    for first in (0, 100, 200):  # the first prompt ends in L2 alone; L1 full of evictable runs
        serve(list(range(first, first + 12)))
    req = cache.admit(list(range(8)))
    assert req.hit[1] == 8 and req.hit[0] == 0
    before = cache.status().to_dict()
    for events, match in (
        ([None] * 3, r"^start_restore: 3 layer_events for 2 layers \(give one per layer\)$"),
        ([None], r"^start_restore: 1 layer_events for 2 layers"),
        ([1, 2], r"^start_restore: layer_events must be events \(torch.cuda.Event\), got 1$"),
        ([None, None], r"^start_restore: layer_events must be events \(torch.cuda.Event\), got None$"),
    ):
        with pytest.raises(MisuseError, match=match):
            cache.start_restore(req, layer_events=events)
        assert cache.status().to_dict() == before and req.state.value == "admitted"
    assert cache.restore(req) and req.cached_len == 8
    assert bool((cache.l1.buffer[:, :, cache.prefix_pages(req)] == 1.0).all())
    cache.release(req)
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("tier", [Tier.L2, Tier.L3])
def test_a_restore_that_fails_after_its_request_was_released_is_not_a_fallback(
    monkeypatch: pytest.MonkeyPatch, tier: Tier
) -> None:
    """Released while its copy (S2H or H2D) already ran, then the copy reports failure: no
    request recomputes, so ``fallbacks`` does not count it (its direction's failure does)."""
    c = make()
    tokens = list(range(8))
    cached(c, tokens, Tier.L1, *([Tier.L2] if tier is Tier.L3 else []))
    _synchronous(monkeypatch, c.device, "h2d")
    _synchronous(monkeypatch, c.storage, "read")
    c.faults.add("eio" if tier is Tier.L3 else "fail", op="read")
    req = c.admit(tokens)
    pending = c.start_restore(req, c.plan(req))
    assert pending is not None
    c.release(req)
    _finish(c, pending)
    assert pending.outcome == "failed" and c.metrics.fallbacks == 0
    assert c.metrics.directions["S2H" if tier is Tier.L3 else "H2D"].failed == 1
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("tier", [Tier.L2, Tier.L3])
def test_a_restore_released_after_its_copy_ran_ends_cancelled(monkeypatch: pytest.MonkeyPatch, tier: Tier) -> None:
    """Released while its copy (S2H or H2D) already ran, so it cannot be withdrawn: the next
    poll ends the restore CANCELLED (not a fallback), and what landed stays in the tree."""
    c = make()
    tokens = list(range(8))
    cached(c, tokens, Tier.L1, *([Tier.L2] if tier is Tier.L3 else []))
    _synchronous(monkeypatch, c.device, "h2d")
    _synchronous(monkeypatch, c.storage, "read")
    req = c.admit(tokens)
    pending = c.start_restore(req, c.plan(req))
    assert pending is not None and pending.stage == ("s2h" if tier is Tier.L3 else "h2d")
    c.release(req)
    assert not pending.finished
    finished = c.poll()
    assert finished == [pending] and pending.stage == "cancelled" and pending.outcome == "cancelled"
    assert c.metrics.fallbacks == 0 and c.metrics.restores == 0
    assert c.core.match(tokens).lengths == ((0, 8, 8) if tier is Tier.L3 else (8, 8, 8))
    st = c.status().core
    assert st.leases == 0 and all(t.in_flight == 0 for t in st.tiers)
    c.check_integrity()
    c.close()


def test_a_restore_in_flight_without_a_transfer_is_an_integrity_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocking restore refuses to spin on a restore that claims to be in flight but
    has no transfer: IntegrityError naming the request and what is wrong."""
    c = make()
    tokens = list(range(8))
    cached(c, tokens, Tier.L1)
    ctl = c.controller
    start = ctl.start_restore
    lost: list[Any] = []

    def without_transfer(req: Request, plan: Plan | None = None, **kw: Any) -> PendingRestore | None:
        pending = start(req, plan, **kw)
        assert pending is not None
        lost.append(pending.transfer)
        pending.transfer = None  # the bug this guards against
        return pending

    monkeypatch.setattr(ctl, "start_restore", without_transfer)
    req = c.admit(tokens)
    with pytest.raises(IntegrityError) as info:
        c.restore(req)
    err = info.value
    assert (err.invariant, err.where) == ("ordering", f"request #{req.id}")
    assert err.detail == "a restore in flight has no transfer"
    assert str(err) == (
        f"invariant 'ordering' broken at request #{req.id}: a restore in flight has no transfer (this is a bug)"
    )
    assert req.restore is not None
    req.restore.transfer = lost[0]
    c.drain()
    c.release(req)
    c.check_integrity()
    c.close()


def test_observe_prefill_teaches_the_recompute_model() -> None:
    """A prefill timing given to the controller reaches the recompute model as a sample."""
    c = make()
    model = c.controller.cost.recompute
    seconds = 2 * model.predict(64)  # near the prediction: taken at once, not held
    before = len(model.samples)
    c.observe_prefill(64, seconds)
    assert list(model.samples)[before:] == [(64.0, seconds)]
    assert model.held is None
    c.close()


def test_note_decode_credits_a_restore_started_during_the_batch_only_its_part() -> None:
    """With ``ended``, a restore is credited ``min(seconds, ended - started)``: all of a
    batch that began after it, the part after its start of one it started beside, nothing
    of one that ended before it started. A bad ``ended`` is refused, nothing credited."""
    c = make()
    cached(c, list(range(8)), Tier.L1)
    req = c.admit(list(range(8)))
    p = c.start_restore(req, c.plan(req))
    assert p is not None and not p.finished
    c.note_decode(0.5, ended=p.started + 10.0)
    c.note_decode(1.0, ended=p.started + 0.25)
    c.note_decode(1.0, ended=p.started - 1.0)
    assert p.overlapped_s == 0.75
    for bad in (float("nan"), "1", True):
        with pytest.raises(MisuseError, match="ended must be a finite"):
            c.note_decode(1.0, ended=bad)  # type: ignore[arg-type]
    assert p.overlapped_s == 0.75
    _finish(c, p)
    c.release(req)
    c.check_integrity()


def test_note_decode_reaches_every_pending_restore() -> None:
    """Decode time noted while several restores are pending is added to each of them."""
    c = make()
    runs = [list(range(8)), [70] * 8]
    for toks in runs:
        cached(c, toks, Tier.L1)
    reqs = [c.admit(toks) for toks in runs]
    pendings = [c.start_restore(r, c.plan(r)) for r in reqs]
    assert all(p is not None and not p.finished for p in pendings)
    c.note_decode(0.25)
    c.note_decode(0.5)
    assert [p.overlapped_s for p in pendings if p is not None] == [0.75, 0.75]
    for p in pendings:
        assert p is not None
        _finish(c, p)
    for r in reqs:
        assert r.cached_len == 8
        c.release(r)
    c.check_integrity()
    c.close()


def test_l3_lost_runs_counts_every_run_a_shared_store_lost() -> None:
    """Each run whose pages vanished from a shared store adds one to metrics.l3_lost_runs."""
    a, store = make_keyed()
    runs = [list(range(4)), [70] * 4]
    for seed, toks in enumerate(runs):
        compute(a, toks, seed=seed)
    b, _ = make_keyed(store)
    seed_key = format_seed(MODEL, KEYED_G)
    for i, toks in enumerate(runs, 1):
        req = b.admit(toks)
        assert req.hit[2] == 4
        store.drop(page_keys(seed_key, toks, KEYED_G.page_size)[1])
        assert not b.restore(req, b.plan(req))
        assert b.metrics.l3_lost_runs == i
        b.release(req)
    b.check_integrity()
    a.close()
    b.close()


def test_a_failed_l3_read_keeps_the_l3_copy() -> None:
    """A read that fails (I/O error) while the pages are still in the store falls back, but
    the run keeps its L3 copy: nothing is counted lost, the next request restores it."""
    c = make()
    tokens = list(range(8))
    kv = cached(c, tokens, Tier.L1, Tier.L2)
    c.faults.add("eio", op="read")
    req = c.admit(tokens)
    assert not c.restore(req, c.plan(req))
    assert c.metrics.fallbacks == 1 and c.metrics.l3_lost_runs == 0
    assert c.core.match(tokens).lengths == (0, 0, 8)
    c.release(req)
    again = c.admit(tokens)
    assert c.restore(again) and again.cached_len == 8
    assert bool((c.l1.buffer[:, :, c.prefix_pages(again)] == kv).all())
    c.release(again)
    c.check_integrity()
    c.close()


def test_publishing_the_wrong_number_of_pages_is_an_integrity_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore about to publish fewer pages than its plan covers is refused as a bug:
    IntegrityError naming the request and the count."""
    c = make()
    tokens = list(range(8))
    cached(c, tokens, Tier.L1)
    ctl = c.controller
    after = ctl._prefix_after
    monkeypatch.setattr(ctl, "_prefix_after", lambda req, transfer: after(req, transfer)[:-1])
    req = c.admit(tokens)
    pending = c.start_restore(req, c.plan(req))
    assert pending is not None
    with pytest.raises(IntegrityError) as info:
        for _ in range(100):
            c.poll()
    err = info.value
    assert (err.invariant, err.where, err.detail) == (
        "request-restore-pages",
        f"request #{req.id}",
        "3 pages published",
    )
    c.close()
