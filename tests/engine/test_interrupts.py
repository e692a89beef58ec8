"""An exception that is no request's failure (Ctrl-C, a bug outside hicache) landing anywhere
in a step: it propagates, every request in flight finishes once (its tokens, or
``interrupted: ...``), nothing stays held in the cache, and every later request gets the
tokens of a recompute (no page the tree owns was written by a request retried over it)."""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable
from typing import Any

import pytest

from hicache.engine import Engine
from tests.engine.test_request_edges import engine as edge_engine

pytest.importorskip("transformers")

PS = 4
# two prompts sharing 2 pages, one page-aligned, one a page and a token; L1 holds about two
PROMPTS = [
    list(range(1, 14)),
    [*range(1, 9), 90, 91, 92, 93, 94],
    list(range(200, 212)),
    list(range(300, 305)),
]
CACHE_CALLS = [
    "admit",
    "plan",
    "allocate",
    "prefix_pages",
    "insert",
    "release",
    "poll",
    "start_restore",
    "restore",
    "observe_prefill",
    "note_decode",
    "settle",
]


class Interrupt(KeyboardInterrupt):
    """Ctrl-C, as Python raises it between two bytecodes."""


def engine() -> Engine:
    """An L1 of about two prompts over L2 and L3: prompts are evicted and restored."""
    return edge_engine(num_pages=12, l2_pages=48, l3_pages=96)


@functools.cache
def reference() -> dict[tuple[int, ...], list[int]]:
    e = Engine("tiny", device="cpu", page_size=PS, num_pages=64)
    try:
        return {tuple(p): e.generate(p, max_new_tokens=3).tokens for p in PROMPTS}
    finally:
        e.close()


def interrupt_at(obj: Any, name: str, nth: int, after: bool) -> list[int]:
    """Make the ``nth`` call of ``obj.name`` raise :class:`Interrupt`, before or after it ran."""
    real: Callable[..., Any] = getattr(obj, name)
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth and not after:
            raise Interrupt(name)
        out = real(*args, **kwargs)
        if calls[0] == nth:
            raise Interrupt(name)
        return out

    setattr(obj, name, wrapped)
    return calls


def serve(
    e: Engine, rounds: int, raised: type[BaseException] = Interrupt
) -> tuple[dict[int, tuple[int, ...]], list[Any], int]:
    """Submit every prompt ``rounds`` times (evicting, restoring from L2 and L3), stepping
    through interrupts (``raised``); the ids submitted, the outputs, the interrupts caught."""
    ids: dict[int, tuple[int, ...]] = {}
    outs: list[Any] = []
    caught = 0
    for _ in range(rounds):
        for p in PROMPTS:
            ids[e.submit(p, max_new_tokens=3)] = tuple(p)
            for _ in range(2):
                try:
                    outs.extend(e.step())
                except raised:
                    caught += 1
    while e.pending:
        try:
            outs.extend(e.run())
        except raised:
            caught += 1
    return ids, outs, caught


def check_served(e: Engine, ids: dict[int, tuple[int, ...]], outs: list[Any], raised: str) -> None:
    """Each request finished exactly once, with a recompute's tokens or ``interrupted:
    <raised>``; nothing held; every prompt then served from what the run left in the cache
    gets a recompute's tokens."""
    want = reference()
    assert sorted(o.id for o in outs) == sorted(ids)
    for o in outs:
        assert o.error is None or o.error == f"interrupted: {raised}", o.error
        if o.error is None:
            assert o.tokens == want[ids[o.id]], (o.id, ids[o.id])
    check_clean(e)
    for p in PROMPTS:
        assert e.generate(p, max_new_tokens=3).tokens == want[tuple(p)], p
    check_clean(e)


def check_clean(e: Engine) -> None:
    e.cache.drain()
    e.cache.check_integrity()
    s = e.cache.status()
    assert s.requests == 0 and s.core.leases == 0, s
    assert all(t.private == 0 and t.protected == 0 for t in s.core.tiers), s.core.tiers


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("nth", [1, 2, 5])
@pytest.mark.parametrize("name", [*CACHE_CALLS, "forward", "_emit", "_behind_a_restore"])
def test_an_interrupt_anywhere_in_a_step_loses_nothing_and_corrupts_nothing(name: str, nth: int, after: bool) -> None:
    e = engine()
    try:
        # the runner's forward, the cache's calls, and the engine's own emitting of an Output
        # (the window between a request's Output and the engine forgetting it) and check of a
        # request taken from the queue (the window before it is admitted)
        target = e.runner if name == "forward" else e if name in ("_emit", "_behind_a_restore") else e.cache
        calls = interrupt_at(target, name, nth, after)
        ids, outs, caught = serve(e, rounds=3)
        assert caught == (1 if calls[0] >= nth else 0)
        check_served(e, ids, outs, "Interrupt")  # the interrupt fires at the nth call only
    finally:
        e.close()


@pytest.mark.parametrize("nth", [2, 3, 5])
def test_an_interrupt_in_a_later_step_of_run_keeps_the_outputs_of_the_earlier(nth: int) -> None:
    """``run()`` cut short in one of its later steps: the requests that finished in its
    earlier steps are not lost (they come from the next call, once each)."""
    e = engine()
    try:
        short = e.submit(PROMPTS[3], max_new_tokens=1)  # finishes in its prefill
        long = e.submit(PROMPTS[0], max_new_tokens=8)
        interrupt_at(e.runner, "forward", nth, after=False)
        with pytest.raises(Interrupt):
            e.run()
        outs = e.run()
        assert sorted(o.id for o in outs) == [short, long] and all(o.error is None for o in outs)
        check_clean(e)
    finally:
        e.close()


def test_an_interrupt_right_after_a_prefill_handed_its_pages_over_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C at the engine's first clock read after ``insert`` handed a prefill's pages to the
    tree: the request has moved on (it decodes, never prefilled again over the tree's pages),
    so every request finishes once with a recompute's tokens, and later ones read good pages."""
    import time as real_time
    from types import SimpleNamespace

    from hicache.engine import engine as engine_module

    e = engine()
    try:
        armed = [0]
        insert = e.cache.insert

        def inserting(*args: Any, **kwargs: Any) -> Any:
            out = insert(*args, **kwargs)
            armed[0] += 1
            return out

        def clock() -> float:
            if armed[0] == 2:  # the second insert's: the first request's prefix already cached
                armed[0] += 1
                raise Interrupt("after insert")
            return real_time.perf_counter()

        setattr(e.cache, "insert", inserting)  # noqa: B010
        monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=clock, sleep=real_time.sleep))
        ids, outs, caught = serve(e, rounds=2)
        assert caught == 1
        check_served(e, ids, outs, "Interrupt")
    finally:
        e.close()


def test_an_abort_cut_short_after_its_output_serves_the_request_once() -> None:
    """An abort of a queued request interrupted between its Output and its leaving the queue:
    the request is not served later (one Output, ``aborted``)."""
    e = edge_engine(num_pages=12, l2_pages=48, l3_pages=96, max_batch=1)
    try:
        first = e.submit(PROMPTS[0], max_new_tokens=3)
        queued = e.submit(PROMPTS[2], max_new_tokens=3)
        interrupt_at(e, "_emit", 1, after=True)
        with pytest.raises(Interrupt):
            e.abort(queued)
        outs = e.run()
        assert sorted(o.id for o in outs) == [first, queued]
        assert next(o for o in outs if o.id == queued).error == "aborted"
        check_clean(e)
    finally:
        e.close()


def test_an_interrupt_while_an_output_is_made_loses_no_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while a request's Output is built: the request is not taken as finished without
    one (it finishes at the next call, once)."""
    from hicache.engine import engine as engine_module

    e = engine()
    try:
        made = [0]
        real = engine_module.Output

        def output(*args: Any) -> Any:
            made[0] += 1
            if made[0] == 1:
                raise Interrupt("Output")
            return real(*args)

        monkeypatch.setattr(engine_module, "Output", output)
        ids, outs, caught = serve(e, rounds=1)
        assert caught == 1
        check_served(e, ids, outs, "Interrupt")
    finally:
        e.close()


@pytest.mark.parametrize("backend", ["dir", "file"])
def test_an_interrupt_while_the_engine_is_built_leaves_its_store_free(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Ctrl-C after the engine opened its cache, before its set-up ended: the cache is
    closed, so the next engine on the same L3 path opens."""
    from hicache.engine import engine as engine_module

    where = str(tmp_path / ("kv" if backend == "dir" else "kv.bin"))
    kw: dict[str, object] = dict(storage_backend=backend, storage_path=where)

    def stats() -> Any:
        raise Interrupt("set-up")

    closed: list[Any] = []
    from hicache.engine.model import ModelRunner

    close = ModelRunner.close

    def closing(runner: Any) -> None:
        closed.append(runner)
        close(runner)

    with monkeypatch.context() as m:
        m.setattr(engine_module, "EngineStats", stats)
        m.setattr(ModelRunner, "close", closing)
        with pytest.raises(Interrupt) as caught:
            edge_engine(**kw)
    assert len(closed) == 1  # its runner too (on a GPU: its streams go to the next engine)
    # NOTE: with the exception still held (an interactive session keeps the last one), so
    # its traceback keeps the half-built engine alive: no finalizer is what frees the store
    edge_engine(**kw).close()
    assert caught.value.args == ("set-up",)


def test_an_interrupt_in_abort_loses_nothing() -> None:
    """Ctrl-C while an abort gives a request's pages back: the request is out once, and the
    next step gives back what it still held."""
    e = engine()
    try:
        rid = e.submit(PROMPTS[0], max_new_tokens=3)
        e.step()
        interrupt_at(e.cache, "release", 1, after=False)
        with pytest.raises(Interrupt):
            e.abort(rid)
        outs = e.run()
        assert [(o.id, o.error) for o in outs] == [(rid, "aborted")]
        assert not e.abort(rid)
        check_clean(e)
        assert e.generate(PROMPTS[0], max_new_tokens=3).tokens == reference()[tuple(PROMPTS[0])]
    finally:
        e.close()


def test_out_of_memory_while_pages_go_to_the_tree_fails_the_request_once() -> None:
    """An out-of-memory error in ``insert`` passes two handlers (the hand-over's and the
    request's): the request finishes once, with an error, and nothing stays held."""
    import torch

    e = engine()
    try:
        real = e.cache.insert
        calls = [0]

        def insert(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                raise torch.OutOfMemoryError("out of memory")
            return real(*args, **kwargs)

        e.cache.insert = insert  # type: ignore[method-assign]
        rid = e.submit(PROMPTS[0], max_new_tokens=3)
        outs = e.run()
        assert [o.id for o in outs] == [rid] and outs[0].error is not None and "OutOfMemoryError" in outs[0].error
        check_clean(e)
        assert e.generate(PROMPTS[0], max_new_tokens=3).tokens == reference()[tuple(PROMPTS[0])]
    finally:
        e.close()


def _requeue_scene() -> tuple[Engine, list[list[int]]]:
    """An L1-only engine whose two prefixes, both cached, fill it: of two requests on them,
    the first admitted cannot allocate beside the other's pins and is requeued."""
    import random

    rng = random.Random(0)
    heads = [[rng.randrange(512) for _ in range(64)] for _ in range(2)]
    e = Engine("tiny", device="cpu", num_pages=10, max_batch=2)
    for h in heads:
        e.generate(h, max_new_tokens=1)
    return e, [h + [i + 1] * 40 for i, h in enumerate(heads)]


@pytest.mark.parametrize("how", ["exception", "signal", "exception then signal"])
def test_an_interrupt_while_a_request_is_requeued_loses_nothing(how: str) -> None:
    """Ctrl-C as a requeue gives a request's pages back: the request is served at a later
    call, once, with the tokens of a recompute. As a real SIGINT where the request is
    neither active nor queued (held until the requeue ends), as an exception out of the
    giving back, its cache request released and the request still active (the step's
    tidy-up queues it again), or as both: a second Ctrl-C while the tidy-up queues it."""
    import collections
    import signal
    import sys

    e, prompts = _requeue_scene()
    ref = Engine("tiny", device="cpu", num_pages=64, net=e.net)
    try:
        want = {tuple(p): ref.generate(p, max_new_tokens=8).tokens for p in prompts}
        fired: list[str] = []
        signals = 1 if how == "signal" else 2 if how == "exception then signal" else 0

        class Waiting(collections.deque):  # type: ignore[type-arg]
            def appendleft(self, seq: Any) -> None:
                if len(fired) == signals - 1 and sys._getframe(1).f_code.co_name == "_requeued":
                    fired.append("signal")
                    signal.raise_signal(signal.SIGINT)  # the request is in neither place
                super().appendleft(seq)

        e._waiting = Waiting(e._waiting)
        if how != "signal":
            real = e._drop

            def drop(seq: Any) -> None:
                real(seq)
                if "exception" not in fired and sys._getframe(1).f_code.co_name == "_requeue":
                    fired.append("exception")
                    raise Interrupt("_drop")

            e._drop = drop  # type: ignore[method-assign]
        ids = {e.submit(p, max_new_tokens=8): tuple(p) for p in prompts}
        outs: list[Any] = []
        caught = 0
        for _ in range(200):
            try:
                outs.extend(e.step())
            except KeyboardInterrupt:
                caught += 1
            if not e.pending:
                break
        assert fired == {"exception": ["exception"], "signal": ["signal"]}.get(how, ["exception", "signal"])
        assert caught == 1  # the second one comes out of the step the first one cut short
        assert sorted(o.id for o in outs) == sorted(ids)  # each request finished exactly once
        for o in outs:
            assert o.error is None, o.error
            assert o.tokens == want[ids[o.id]]
        check_clean(e)
    finally:
        ref.close()
        e.close()


class Timeout(Exception):
    """What a timeout's SIGALRM handler raises."""


def step_through(e: Engine, raised: type[BaseException]) -> tuple[list[Any], int]:
    """Step until nothing is pending (bounded: a few steps serve one request), catching
    ``raised``; the outputs and how many were caught."""
    outs: list[Any] = []
    caught = 0
    for _ in range(1_000):
        try:
            outs.extend(e.step())
        except raised:
            caught += 1
        if not e.pending:
            break
    return outs, caught


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="no SIGALRM here")
@pytest.mark.parametrize("nth", [1, 3])
@pytest.mark.parametrize("step", ["adopt", "free_private", "lock", "release", "start", "complete", "evict_node"])
def test_a_timeout_raised_by_a_signal_handler_inside_the_bookkeeping_loses_nothing(step: str, nth: int) -> None:
    """A SIGALRM handler that raises (``signal.alarm`` with a timeout), the signal coming in
    the middle of the cache's bookkeeping (right after the core's ``step``): the exception
    comes out of the step once the cache call has done all it does, every request finishes
    exactly once, nothing stays held and every later request gets a recompute's tokens."""
    raised: list[int] = []

    def timeout(signum: int, frame: object) -> None:
        raised.append(signum)
        raise Timeout

    before = signal.signal(signal.SIGALRM, timeout)
    e = engine()  # NOTE: after the handler is set: a cache holds the handlers in place when it opens
    try:
        core = e.cache.controller.core
        real: Callable[..., Any] = getattr(core, step)
        calls = [0]

        def then_signal(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            calls[0] += 1
            if calls[0] == nth:
                signal.raise_signal(signal.SIGALRM)
            return out

        setattr(core, step, then_signal)
        ids, outs, caught = serve(e, rounds=3, raised=Timeout)
        assert caught == len(raised) == (1 if calls[0] >= nth else 0)
        setattr(core, step, real)
        check_served(e, ids, outs, "Timeout")
    finally:
        e.close()
        signal.signal(signal.SIGALRM, before)


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="no SIGALRM here")
@pytest.mark.parametrize("tier", ["L2", "L3"])
def test_a_timeout_while_a_blocking_restore_waits_leaves_the_request_to_finish(
    tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prefetch=False`` restores at admission and waits there, with signals not held: a
    SIGALRM handler's exception raised while it waits comes out of the step, the restore goes
    on in flight, and the request finishes with a recompute's tokens (it was failed with a
    MisuseError: prefilled over a prefix still loading)."""
    from hicache.backends.stores.base import StoreTicket
    from hicache.backends.ticket import Ticket
    from hicache.spec.model import Tier
    from tests.engine.test_request_edges import drop

    def timeout(signum: int, frame: object) -> None:
        raise Timeout

    before = signal.signal(signal.SIGALRM, timeout)
    e = edge_engine(prefetch=False)
    try:
        prompt = list(range(1, 30))
        want = e.generate(prompt, max_new_tokens=3).tokens
        drop(e, Tier.L1, Tier.L2) if tier == "L3" else drop(e, Tier.L1)
        owner = StoreTicket if tier == "L3" else Ticket
        real = owner.wait
        fired = [0]

        def wait_then_signal(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not fired[0]:
                fired[0] = 1
                signal.raise_signal(signal.SIGALRM)
            return real(self, *args, **kwargs)

        # NOTE: monkeypatch, not setattr and back: StoreTicket inherits wait, and setting the
        # inherited function back on it would hide later patches of Ticket.wait from it
        with monkeypatch.context() as patched:
            patched.setattr(owner, "wait", wait_then_signal)
            rid = e.submit(prompt, max_new_tokens=3)
            outs, caught = step_through(e, Timeout)
        assert fired[0] == caught == 1
        assert [(o.id, o.error, o.tokens) for o in outs] == [(rid, None, want)]
        check_clean(e)
        assert e.generate(prompt, max_new_tokens=3).tokens == want
        check_clean(e)
    finally:
        e.close()
        signal.signal(signal.SIGALRM, before)


def test_an_interrupt_right_after_a_blocking_restore_returned_leaves_the_request_served() -> None:
    """``prefetch=False``: an interrupt after the blocking restore has returned (a guard's
    check, a timeout's handler on the way out): the restore ended and no poll will report
    it, so the request goes on with what it restored instead of waiting for good."""
    from hicache.spec.model import Tier
    from tests.engine.test_request_edges import drop

    e = edge_engine(prefetch=False)
    try:
        prompt = list(range(1, 30))
        want = e.generate(prompt, max_new_tokens=3).tokens
        drop(e, Tier.L1)
        controller = e.cache.controller
        real = controller.restore

        def restore_then_interrupt(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)
            controller.restore = real  # type: ignore[method-assign]
            raise Interrupt("right after the restore returned")

        controller.restore = restore_then_interrupt  # type: ignore[method-assign]
        rid = e.submit(prompt, max_new_tokens=3)
        outs, caught = step_through(e, Interrupt)
        assert caught == 1 and not e.pending
        assert [(o.id, o.error, o.tokens) for o in outs] == [(rid, None, want)]
        check_clean(e)
    finally:
        e.close()


@pytest.mark.parametrize("where", ["after poll returned them", "after the first was handed over"])
def test_an_interrupt_while_finished_restores_are_handed_over_leaves_none_waiting(where: str) -> None:
    """Two restores finish in one poll: an interrupt once poll has returned them (on its way
    out), or between their hand-overs, loses that list, and no poll reports them again; the
    next step still hands each to its request, once (each was left RESTORING for good and
    ``run()`` spun forever)."""
    from hicache.spec.model import Tier
    from tests.engine.test_request_edges import drop

    e = edge_engine()
    try:
        a, b = list(range(1, 30)), list(range(100, 130))
        want = {tuple(p): e.generate(p, max_new_tokens=2).tokens for p in (a, b)}
        drop(e, Tier.L1)
        fired = [0]
        if where == "after poll returned them":
            real_poll = e.cache.poll

            def poll() -> Any:
                out = real_poll()
                if len(out) == 2 and not fired[0]:
                    fired[0] = 1
                    raise Interrupt("after poll returned")
                return out

            e.cache.poll = poll  # type: ignore[method-assign]
        else:
            real_restored = e._restored

            def restored(restore: Any) -> None:
                real_restored(restore)
                if not fired[0]:
                    fired[0] = 1
                    raise Interrupt("between two hand-overs")

            e._restored = restored  # type: ignore[method-assign]
        ids = {e.submit(p, max_new_tokens=2): tuple(p) for p in (a, b)}
        outs, caught = step_through(e, Interrupt)
        assert fired[0] == caught == 1
        assert not e.pending, {rid: e.state_of(rid) for rid in ids}
        assert sorted((o.id, o.error, o.tokens) for o in outs) == sorted((i, None, want[p]) for i, p in ids.items())
        assert e.stats.restores_failed == 0
        check_clean(e)
    finally:
        e.close()
