"""The engine at the request level's edges: prompts around a page under every write policy
through L2 and L3 restores, aborts in every state, requests that can never fit, and the
same tokens as a recompute."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
import torch

from hicache.engine import Engine
from hicache.engine import engine as engine_module
from hicache.engine.engine import EngineConfig, Output, RequestFailed, SeqState
from hicache.errors import ConfigError, MisuseError
from hicache.spec.model import Tier

pytest.importorskip("transformers")

PS = 4
POLICIES = ["write_through", "write_through_selective", "write_back"]


def engine(**kw: object) -> Engine:
    args: dict[str, object] = dict(
        device="cpu",
        page_size=PS,
        num_pages=48,
        enable_hicache=True,
        l2_pages=64,
        l3_pages=128,
        policy="always",
        transfer_backend="torch",
    )
    args.update(kw)
    return Engine("tiny", **args)  # type: ignore[arg-type]


def drop(e: Engine, *tiers: Tier) -> None:
    """Evict the tiers' unpinned copies; L1 through the cache, so write_back backs up first."""
    e.cache.drain()
    for t in tiers:
        if t is Tier.L1:
            st = e.cache.status().core.tiers[0]
            req = e.cache.admit([1])
            assert e.cache.allocate(req, st.free + st.evictable) is not None
            e.cache.release(req)
            e.cache.drain()
        e.cache.core.evict(t, 10**6)


def closed_clean(e: Engine) -> None:
    """Once the backups in flight finish (they hold leases until then), no request, lease or
    restore is left and the invariants hold; then close."""
    e.cache.drain()
    st = e.cache.status()
    assert st.requests == 0 and st.core.leases == 0 and st.pending_restores == 0
    e.cache.check_integrity()
    e.close()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("length", [1, PS - 1, PS, PS + 1, 3 * PS + 2])
def test_prompts_around_a_page_are_served_and_restored_bit_exactly(length: int, policy: str) -> None:
    """1, page-1, page, page+1 tokens and more, under every write policy: the prompt again,
    restored from L2 and then from L3, gives the tokens and first logits of an L1 hit. The
    last prompt token is always computed, so the cached prefix is the whole pages before it
    (a page-aligned prompt recomputes its last page)."""
    e = engine(write_policy=policy)
    prompt = [(7 * i + 3) % 500 for i in range(length)]
    e.generate(prompt, max_new_tokens=3)
    hit = e.generate(prompt, max_new_tokens=3)  # over its cached prefix, as a restore reads it
    e.generate(prompt, max_new_tokens=3)  # a second hit: write_through_selective backs it up
    aligned = (length - 1) // PS * PS
    assert hit.cached_tokens == aligned
    for tiers, source in (((Tier.L1,), "L2"), ((Tier.L1, Tier.L2), "L3")):
        drop(e, *tiers)
        again = e.generate(prompt, max_new_tokens=3)
        assert (again.restored_from, again.cached_tokens) == ((source, aligned) if aligned else ("L1", 0))
        assert again.tokens == hit.tokens
        assert again.first_logits is not None and hit.first_logits is not None
        assert bool((again.first_logits == hit.first_logits).all())
    e.cache.check_integrity()
    e.close()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pages", [1, 2, 5])
def test_a_cached_page_aligned_prompt_that_fills_the_pool_is_served_again(pages: int, policy: str) -> None:
    """A page-aligned prompt whose tokens and new tokens fill L1 exactly (what submit
    checks) is served cached from L1, then restored from L2 and L3, with the cold tokens:
    its last page, recomputed anyway, is neither pinned nor restored."""
    max_new = 2
    prompt = [(11 * i + 5) % 500 for i in range(pages * PS)]
    num_pages = -(-(len(prompt) + max_new) // PS)
    cold = Engine("tiny", device="cpu", page_size=PS, num_pages=num_pages)
    want = cold.generate(prompt, max_new_tokens=max_new)
    cold.close()
    e = engine(num_pages=num_pages, write_policy=policy)
    first = e.generate(prompt, max_new_tokens=max_new)
    runs = [e.generate(prompt, max_new_tokens=max_new), e.generate(prompt, max_new_tokens=max_new)]
    for tiers in ((Tier.L1,), (Tier.L1, Tier.L2)):
        drop(e, *tiers)
        runs.append(e.generate(prompt, max_new_tokens=max_new))
    for out in [first, *runs]:
        assert out.error is None and out.tokens == want.tokens, out
        assert out.first_logits is not None and want.first_logits is not None
        assert torch.equal(out.first_logits, want.first_logits)
    assert [o.cached_tokens for o in runs] == [(pages - 1) * PS] * 4
    restored = [o.restored_from for o in runs[2:]]
    assert restored == (["L2", "L3"] if pages > 1 else ["L1", "L1"])
    e.cache.drain()  # backups still in flight hold leases until they finish
    st = e.cache.status()
    assert st.requests == 0 and st.core.leases == 0 and st.core.tiers[0].private == 0
    e.cache.check_integrity()
    e.close()


def test_a_partial_match_limit_is_checked_and_the_facade_keeps_whole_hits() -> None:
    """``admit(at_most=...)`` caps the match (page-aligned below it); a bad value is a
    MisuseError that pins nothing; without it the whole cached prompt is the hit."""
    e = engine()
    prompt = list(range(3 * PS))
    e.generate(prompt)
    cache = e.cache
    cache.drain()
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(MisuseError, match="at_most"):
            cache.admit(prompt, at_most=bad)  # type: ignore[arg-type]
    assert cache.status().requests == 0 and cache.status().core.leases == 0
    for at_most, want in ((None, 3 * PS), (3 * PS, 3 * PS), (3 * PS - 1, 2 * PS), (PS, PS), (0, 0), (10**9, 3 * PS)):
        req = cache.admit(prompt, at_most=at_most)
        assert req.cached_len == want and len(cache.prefix_pages(req)) == want // PS, at_most
        cache.release(req)
    assert cache.status().core.leases == 0
    e.close()


def test_an_empty_or_impossible_prompt_is_refused_at_submit() -> None:
    e = engine(num_pages=4)
    with pytest.raises(MisuseError):
        e.submit([])
    with pytest.raises(ConfigError, match="no room in L1 for a prompt of 20 tokens"):
        e.submit(list(range(20)), max_new_tokens=1)
    assert e.pending == 0 and e.stats.submitted == 0
    e.close()


def test_a_request_longer_than_the_models_context_is_refused_at_submit() -> None:
    """A prompt and its new tokens past the model's ``max_position_embeddings`` are a
    ConfigError naming both counts; nothing is queued, and a request that fits is served."""
    e = engine()
    e.net.config.max_position_embeddings = 40  # type: ignore[union-attr]  # a checkpoint made for 40 positions
    with pytest.raises(ConfigError, match="a prompt of 30 tokens and 11 new needs 41 positions, the model has 40"):
        e.submit(list(range(30)), max_new_tokens=11)
    assert e.pending == 0 and e.stats.submitted == 0
    out = e.generate(list(range(30)), max_new_tokens=10)
    assert len(out.tokens) == 10 and e.stats.submitted == 1
    e.close()


@pytest.mark.parametrize("when", ["waiting", "restoring", "ready", "decoding"])
def test_an_abort_in_every_state_leaks_nothing(when: str) -> None:
    """A request aborted while waiting, restoring (an L3 read in flight), ready (a decode
    batch went first) or decoding gives back every page and pin; the rest are served."""
    e = engine(max_batch=2)
    cached = list(range(10, 30))
    e.generate(cached, max_new_tokens=2)
    drop(e, Tier.L1, Tier.L2)
    e.submit(list(range(100, 110)), max_new_tokens=20)  # decoding in the background
    e.step()
    e.cache.faults.add("slow", op="read", delay_s=0.05)
    rid = e.submit(cached if when == "restoring" else list(range(200, 215)), max_new_tokens=4)
    third = e.submit(list(range(300, 310)), max_new_tokens=2)  # waits: the batch is full
    target = third if when == "waiting" else rid
    for _ in range(100):
        if e.state_of(target) is SeqState(when):
            break
        e.step()
    assert e.state_of(target) is SeqState(when)
    assert e.abort(target)
    outs = e.run()
    assert sorted((o.id, o.error) for o in outs if o.error) == [(target, "aborted")] and len(outs) == 3
    e.cache.drain()
    st = e.cache.status()
    assert st.requests == 0 and st.core.leases == 0 and st.core.tiers[0].private == 0
    e.cache.check_integrity()
    e.close()


def test_a_request_that_cannot_be_served_finishes_with_an_error_and_the_engine_goes_on() -> None:
    """A cache refusal inside the step fails that request only."""
    e = engine()
    rid = e.submit([1, 2, 3, 4, 5])
    real = e.cache.admit

    def refusing(tokens: object, **kw: object) -> object:
        raise MisuseError("refused for this test")

    e.cache.admit = refusing  # type: ignore[method-assign, assignment]
    outs = e.step()
    e.cache.admit = real  # type: ignore[method-assign]
    assert [o.error for o in outs if o.id == rid] == ["MisuseError: refused for this test"]
    assert e.generate([1, 2, 3]).error is None
    with pytest.raises(RequestFailed):
        e.cache.admit = refusing  # type: ignore[method-assign, assignment]
        e.generate([4, 5])
    e.close()


def test_engine_config_is_the_one_way_settings_arrive() -> None:
    cfg = EngineConfig.create("tiny", device="cpu", page_size=PS, num_pages=16, max_batch=2)
    e = Engine(cfg)
    assert e.max_batch == 2 and e.cache.config.l1_pages == 16 and not e.enabled
    e.close()
    with pytest.raises(ConfigError):
        Engine(cfg, max_batch=3)
    with pytest.raises(ConfigError):
        EngineConfig.create("tiny", device="cpu", no_such_setting=1)
    with pytest.raises(ConfigError):
        EngineConfig.create("tiny", device="cpu", enable_hicache=True)  # no L2 pages


@pytest.mark.parametrize("policy", ["write_through", "write_back"])  # they back up: the hits stay in L1
def test_requests_that_do_not_fit_together_take_turns_instead_of_failing(policy: str) -> None:
    """Three shared prefixes, L1 of 14 pages, three requests admitted at a time: their pinned
    hits fill L1, so one gives its pins back and waits; every request is served, with the
    tokens it gets alone (none fails for room that frees up later)."""
    prefixes = [[(31 * r + 7 * i) % 500 for i in range(5 * PS)] for r in range(3)]
    prompts = [prefixes[k % 3] + [(13 * k + j) % 500 for j in range(PS + 1)] for k in range(9)]
    alone = engine(num_pages=64)
    want = [alone.generate(p, max_new_tokens=2).tokens for p in prompts]
    e = engine(num_pages=14, write_policy=policy, max_batch=3)
    rids = [e.submit(p, max_new_tokens=2) for p in prompts]
    outs = {o.id: o for o in e.run()}
    assert [outs[r].error for r in rids] == [None] * len(rids)
    assert [outs[r].tokens for r in rids] == want
    assert e.stats.requeued > 0  # the case arose: some request gave its pins back
    e.cache.check_integrity()


def test_a_requeued_request_is_admitted_again_when_the_others_are_aborted() -> None:
    """Two requests whose pinned hits fill L1 together: one gives its pins back and waits;
    the client then aborts the other. The waiting one is admitted and served (the engine
    does not wait for a prefill or decode that will never come)."""
    pa = [(7 * i + 3) % 500 for i in range(5 * PS)]
    pb = [(11 * i + 5) % 500 for i in range(5 * PS)]
    e = engine(num_pages=14, max_batch=2)
    e.generate(pa, 1)
    e.generate(pb, 1)  # both prefixes in L1: 10 of 14 pages
    rids = [e.submit(pa + list(range(17)), 2), e.submit(pb + list(range(17)), 2)]
    for _ in range(1000):
        e.step()
        if e.stats.requeued:
            break
    assert e.stats.requeued == 1
    waiting = next(r for r in rids if e.state_of(r) is SeqState.WAITING)
    other = next(r for r in rids if r != waiting)
    assert e.abort(other)
    outs = []
    for _ in range(1000):  # bounded: a stuck engine shows as requests still pending
        if not e.pending:
            break
        outs += e.step()
    assert e.pending == 0
    assert sorted((o.id, o.error) for o in outs) == sorted([(waiting, None), (other, "aborted")])
    e.cache.check_integrity()


@pytest.mark.parametrize("hicache", [False, True])
def test_a_hit_on_the_head_of_a_run_pins_only_the_hit(hicache: bool) -> None:
    """A 28-token prompt leaves one 7-page run in an 8-page L1; a prompt of its first 9
    tokens hits 2 of those pages and needs 4 with its new tokens. Only the 2 are pinned
    (the run is split there), so the other 5 make room: it is served, with the tokens of a
    cold run, where pinning the whole run failed it for lack of room."""
    rng = random.Random(0)
    a = [rng.randrange(512) for _ in range(28)]
    off: dict[str, object] = dict(enable_hicache=False, l2_pages=0, l3_pages=0)
    kw: dict[str, object] = dict(write_policy="write_back") if hicache else off
    e = engine(num_pages=8, **kw)
    e.generate(a, 1)
    e.cache.drain()  # a write-through backup pins its run until it lands
    req = e.cache.admit(a[:9])
    try:
        assert req.cached_len == 8 and len(req.pages) == 2
        st = e.cache.status().to_dict()["core"]["tiers"][0]
        assert st["protected"] == 2, st
    finally:
        e.cache.release(req)
    out = e.generate(a[:9], 7)
    cold = engine(num_pages=8).generate(a[:9], 7)
    assert out.error is None and out.cached_tokens == 8 and out.tokens == cold.tokens
    e.cache.check_integrity()


@pytest.mark.parametrize("priors", [{}, 0, False, "", [], "fast", 1])
def test_priors_that_are_not_cost_priors_are_refused_even_when_falsy(priors: object) -> None:
    """``priors`` is a CostPriors or None (the defaults); anything else, an empty dict or 0
    among them, is a ConfigError (they were taken as the defaults)."""
    with pytest.raises(ConfigError, match="priors must be a CostPriors"):
        EngineConfig.create("tiny", device="cpu", enable_hicache=True, l2_pages=8, priors=priors)  # type: ignore[arg-type]


def on_one_prefix(
    *, seed: int, pages: int, count: int, tail: int, max_new: int
) -> tuple[list[list[int]], list[list[int]]]:
    """``count`` prompts of one ``pages``-page prefix and ``tail`` tokens of their own, and
    the tokens a cold engine (no hicache, nothing cached) gives each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(500) for _ in range(pages * PS)]
    prompts = [prefix + [rng.randrange(500) for _ in range(tail)] for _ in range(count)]
    cold = Engine("tiny", device="cpu", page_size=PS, num_pages=64)
    want = [cold.generate(p, max_new_tokens=max_new).tokens for p in prompts]
    cold.close()
    return prompts, want


@pytest.mark.parametrize("tier", [Tier.L2, Tier.L3])
@pytest.mark.parametrize("policy", POLICIES)
def test_requests_on_a_prefix_being_restored_wait_for_it_instead_of_recomputing(
    tier: Tier, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests on one cached prefix arrive together: the first restores it, the other
    two wait until it lands and take it from L1 (they used to find its copy in flight and
    recompute, two counted fallbacks); each gets the tokens of a cold engine."""
    monkeypatch.setattr(engine_module, "RESTORE_WAIT_MIN_S", 3600.0)  # however slow this machine
    prompts, want = on_one_prefix(seed=5, pages=16, count=3, tail=3, max_new=2)
    e = engine(write_policy=policy)
    for _ in range(3):  # computed, then two hits: write_through_selective backs it up
        e.generate(prompts[0], max_new_tokens=2)
    drop(e, *((Tier.L1,) if tier is Tier.L2 else (Tier.L1, Tier.L2)))
    e.cache.faults.add("slow", op="read", delay_s=0.05)  # an L3 read still in flight at the next step
    ids = [e.submit(p, max_new_tokens=2) for p in prompts]
    outs = {o.id: o for o in e.run()}
    got = [outs[i] for i in ids]
    assert [o.tokens for o in got] == want and all(o.error is None for o in got)
    assert [(o.restored_from, o.cached_tokens) for o in got] == [(tier.name, 16 * PS)] + [("L1", 16 * PS)] * 2
    assert e.cache.metrics.fallbacks == 0
    closed_clean(e)


@pytest.mark.parametrize("abort", ["restoring", "waiting"])
def test_an_abort_on_either_side_of_a_wait_behind_a_restore_leaks_nothing(
    abort: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request whose restore another waits behind is aborted (the waiter is then
    admitted and served), or the waiter is (it leaves the queue): the other is served with
    a cold engine's tokens and nothing stays pinned."""
    monkeypatch.setattr(engine_module, "RESTORE_WAIT_MIN_S", 3600.0)
    prompts, want = on_one_prefix(seed=6, pages=8, count=2, tail=2, max_new=3)
    e = engine()
    e.generate(prompts[0], max_new_tokens=3)
    drop(e, Tier.L1, Tier.L2)
    e.cache.faults.add("slow", op="read", delay_s=0.1)
    a, b = (e.submit(p, max_new_tokens=3) for p in prompts)
    e.step()
    assert e.state_of(a) is SeqState.RESTORING and e.state_of(b) is SeqState.WAITING
    gone, kept = (a, b) if abort == "restoring" else (b, a)
    assert e.abort(gone)
    outs = {o.id: o for o in e.run()}
    assert outs[gone].error == "aborted" and outs[kept].error is None
    assert outs[kept].tokens == want[[a, b].index(kept)]
    closed_clean(e)


def test_a_retry_of_a_request_aborted_while_restoring_waits_for_that_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request aborted while its prefix is read from L3 (a client's cancel): the read goes
    on into the tree, and a retry of the same prompt waits for it (holding nothing) and then
    restores the prefix, instead of finding the read in flight and recomputing (a counted
    fallback); it gets a cold engine's tokens and nothing leaks."""
    monkeypatch.setattr(engine_module, "RESTORE_WAIT_MIN_S", 3600.0)  # however slow this machine
    prompts, want = on_one_prefix(seed=8, pages=8, count=1, tail=2, max_new=3)
    e = engine(storage_deadline_s=None)
    e.generate(prompts[0], max_new_tokens=3)
    drop(e, Tier.L1, Tier.L2)
    e.cache.faults.add("hang", op="read")
    first = e.submit(prompts[0], max_new_tokens=3)
    for _ in range(3_000):  # bounded: until its read is issued and held
        e.step()
        if e.cache.faults.hanging:
            break
        threading.Event().wait(0.01)
    assert e.cache.faults.hanging == 1 and e.state_of(first) is SeqState.RESTORING
    assert e.abort(first)
    retry = e.submit(prompts[0], max_new_tokens=3)
    for _ in range(5):
        e.step()
    assert e.state_of(retry) is SeqState.WAITING  # held back, holding nothing
    assert e.cache.status().requests == 0
    e.cache.faults.release()
    outs = {o.id: o for o in e.run()}
    got = outs[retry]
    assert got.error is None and got.tokens == want[0]
    assert (got.restored_from, got.restore_failed, got.cached_tokens) == ("L2", False, 8 * PS)
    assert e.cache.metrics.fallbacks == 0
    closed_clean(e)


def test_a_wait_behind_a_restore_ends_once_the_restore_outlasts_a_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore that has run longer than a recompute of the head it brings (a hung disk
    without a deadline) holds back the requests on that head no longer: they are admitted
    and served with a cold engine's tokens while it still hangs; nothing leaks after."""
    prompts, want = on_one_prefix(seed=7, pages=8, count=2, tail=2, max_new=2)
    e = engine(storage_deadline_s=None)
    e.generate(prompts[0], max_new_tokens=2)
    drop(e, Tier.L1, Tier.L2)
    e.cache.faults.add("hang", op="read")
    a, b = (e.submit(p, max_new_tokens=2) for p in prompts)
    monkeypatch.setattr(engine_module, "RESTORE_WAIT_MIN_S", 3600.0)
    for _ in range(3):
        e.step()
    assert e.state_of(a) is SeqState.RESTORING and e.state_of(b) is SeqState.WAITING
    monkeypatch.setattr(engine_module, "RESTORE_WAIT_MIN_S", 0.0)
    e._active[a].restore_started -= 3600.0  # an hour: longer than any recompute of 8 pages
    outs: dict[int, Output] = {}
    for _ in range(100):  # bounded: b is served by recomputing
        outs.update((o.id, o) for o in e.step())
        if b in outs:
            break
    assert outs[b].error is None and outs[b].tokens == want[1]
    assert e.state_of(a) is SeqState.RESTORING  # still hung
    assert e.abort(a)
    e.cache.faults.release()
    closed_clean(e)


def test_requests_held_back_stay_queued_when_an_admission_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Something that is not a request's failure (a bug, an interrupt) escapes the admission
    of a request queued behind one held back for a restore: both wait again, in order, and
    every request is served with a cold engine's tokens (the held-back one was dropped)."""
    monkeypatch.setattr(engine_module, "RESTORE_WAIT_MIN_S", 3600.0)
    prompts, want = on_one_prefix(seed=8, pages=8, count=2, tail=2, max_new=2)
    (other,), (other_want,) = on_one_prefix(seed=9, pages=1, count=1, tail=3, max_new=2)
    e = engine()
    e.generate(prompts[0], max_new_tokens=2)
    drop(e, Tier.L1)
    real, raised = e.cache.admit, list[int]()

    def admit(tokens: list[int], **kw: object) -> object:
        if list(tokens) == other and not raised:
            raised.append(1)
            raise RuntimeError("not a request's failure")
        return real(tokens, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(e.cache, "admit", admit)
    a, b, c = (e.submit(p, max_new_tokens=2) for p in [*prompts, other])
    with pytest.raises(RuntimeError, match="not a request's failure"):
        e.step()
    assert raised and e.state_of(b) is SeqState.WAITING and e.state_of(c) is SeqState.WAITING
    assert [s.id for s in e._waiting] == [b, c]
    outs = {o.id: o for o in e.run()}
    assert [outs[i].tokens for i in (a, b, c)] == [*want, other_want]
    assert all(outs[i].error is None for i in (a, b, c))
    closed_clean(e)


def test_admission_holds_back_a_bounded_number_of_requests_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``DEFERRED_PER_STEP`` requests held back behind restores in one step, admission
    waits for the next step (a burst on one prefix costs each step that many comparisons,
    not the whole queue's); every request is then served, without a fallback."""
    monkeypatch.setattr(engine_module, "RESTORE_WAIT_MIN_S", 3600.0)
    monkeypatch.setattr(engine_module, "DEFERRED_PER_STEP", 1)
    prompts, want = on_one_prefix(seed=10, pages=8, count=3, tail=2, max_new=2)
    (other,), (other_want,) = on_one_prefix(seed=11, pages=1, count=1, tail=3, max_new=2)
    e = engine()
    e.generate(prompts[0], max_new_tokens=2)
    drop(e, Tier.L1)
    ids = [e.submit(p, max_new_tokens=2) for p in [*prompts, other]]
    e.step()
    assert [e.state_of(i) for i in ids] == [SeqState.RESTORING] + [SeqState.WAITING] * 3
    outs = {o.id: o for o in e.run()}
    assert [outs[i].tokens for i in ids] == [*want, other_want]
    assert e.cache.metrics.fallbacks == 0
    e.close()


def test_a_drain_during_a_restore_leaves_the_engine_able_to_finish_it() -> None:
    """``cache.drain()`` called between steps finishes a restore the engine waits for; the
    next step's poll still hands it over, so neither it nor a request waiting behind it
    hangs."""
    prompts, want = on_one_prefix(seed=12, pages=8, count=2, tail=2, max_new=2)
    e = engine()
    e.generate(prompts[0], max_new_tokens=2)
    drop(e, Tier.L1, Tier.L2)
    e.cache.faults.add("slow", op="read", delay_s=0.05)
    a, b = (e.submit(p, max_new_tokens=2) for p in prompts)
    e.step()
    assert e.state_of(a) is SeqState.RESTORING
    e.cache.drain()
    outs: dict[int, Output] = {}
    for _ in range(100):  # bounded: both finish in a few steps
        outs.update((o.id, o) for o in e.step())
        if len(outs) == 2:
            break
    assert sorted(outs) == [a, b]
    assert [outs[i].tokens for i in (a, b)] == want
    e.close()


@pytest.mark.parametrize(
    "call", ["abort", "close", "submit", "step", "run", "generate", "status", "state_of", "pending"]
)
def test_a_call_from_another_thread_is_refused_before_it_changes_anything(call: str) -> None:
    """The engine, like its cache, is single-threaded: a call from another thread raises
    MisuseError and leaves the request where it was (an abort from another thread had dropped
    the request from the engine while its cache request, lease and pages stayed held); the
    owner thread then serves it to the end, leaving nothing held."""
    e = engine()
    rid = e.submit(list(range(1, 3 * PS + 2)), max_new_tokens=6)
    e.step()
    e.step()
    before = (e.state_of(rid), e.pending, e.cache.status().requests)
    assert before[0] is not None and before[2] == 1
    calls: dict[str, Callable[[], object]] = {
        "abort": lambda: e.abort(rid),
        "close": e.close,
        "submit": lambda: e.submit([5, 6, 7]),
        "step": e.step,
        "run": e.run,
        "generate": lambda: e.generate([5, 6, 7]),
        "status": e.status,
        "state_of": lambda: e.state_of(rid),
        "pending": lambda: e.pending,
    }
    raised: list[BaseException] = []

    def other() -> None:
        try:
            calls[call]()
        except BaseException as exc:
            raised.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], MisuseError), raised
    assert "single-threaded" in str(raised[0])
    assert (e.state_of(rid), e.pending, e.cache.status().requests) == before
    outs = e.run()
    assert [o.id for o in outs] == [rid] and outs[0].error is None and len(outs[0].tokens) == 6
    closed_clean(e)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_engine_writes_only_the_pages_it_owns(policy: str) -> None:
    """The reference engine under the page guard: many requests on shared prefixes, served
    from L1, L2 and L3 while others are aborted at random steps; after every step no free
    page was written and no cached prefix changed, and each output is a recompute's."""
    rng = random.Random(7)
    lengths = (PS * 3, PS * 5 + 1, PS * 2 - 1, PS * 4, PS * 6 - 1, PS * 4 + 2)
    heads = [[rng.randrange(500) for _ in range(n)] for n in lengths]
    prompts = [h + [rng.randrange(500) for _ in range(rng.randrange(1, 2 * PS))] for h in heads for _ in range(2)]
    e = engine(write_policy=policy, guard_pages=True, num_pages=20, l2_pages=24, l3_pages=64)
    fresh = Engine("tiny", device="cpu", page_size=PS, num_pages=64)
    want = {tuple(p): fresh.generate(p, max_new_tokens=3).tokens for p in prompts}
    fresh.close()
    for _ in range(5):
        ids = {e.submit(p, max_new_tokens=3): p for p in rng.sample(prompts, len(prompts))}
        done: list[Output] = []
        for _ in range(2000):
            if not e.pending:
                break
            done += e.step()
            e.cache.check_integrity()
            if rng.random() < 0.15:
                e.abort(rng.choice(list(ids)))
        assert not e.pending
        for out in done:
            if out.error is None:
                assert out.tokens == want[tuple(ids[out.id])], out
    if policy != "write_through_selective":  # NOTE: it backs up a prefix hit twice in L1; here few are
        assert e.cache.status().metrics["restores"] > 0
    closed_clean(e)
