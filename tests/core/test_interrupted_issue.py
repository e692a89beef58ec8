"""An interrupt (Ctrl-C) raised while a mover issues a copy: before it queues anything, or
after (the copy queued, its ticket never handed back). The interrupt reaches the caller;
the transfer fails, so nothing stays held once the request is released, the cache stays
consistent, and every page served later is bit-identical to the page written."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.backends.stores.mover import StoreMover
from hicache.backends.transfer import TransferEngine
from hicache.core import interrupts
from hicache.core.geometry import KVGeometry
from hicache.errors import IntegrityError
from hicache.spec.model import Direction, Tier

PS = 2
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PS, dtype=torch.float32)
A, B, C = list(range(7)), list(range(100, 107)), list(range(200, 207))


class Armed:
    """Raises KeyboardInterrupt once, in the armed call, before or after the real one."""

    def __init__(self) -> None:
        self.call: str | None = None
        self.after = False
        self.fired = 0

    def arm(self, call: str, after: bool) -> None:
        self.call, self.after = call, after

    def around(self, call: str, real: Callable[[], Any]) -> Any:
        if self.call != call:
            return real()
        self.call = None
        self.fired += 1
        if not self.after:
            raise KeyboardInterrupt
        real()
        raise KeyboardInterrupt


class Mover:
    """The real L1 <-> L2 mover behind an :class:`Armed` switch."""

    def __init__(self, cache: HiCache, armed: Armed) -> None:
        self.inner = TransferEngine(cache.l1, cache.l2, "torch")
        self.armed = armed

    @property
    def layered(self) -> bool:
        return self.inner.layered

    def layer_groups(self) -> list[tuple[int, int]]:
        return self.inner.layer_groups()

    def status(self) -> dict[str, Any]:
        return self.inner.status()

    def d2h(self, src: Sequence[int], dst: Sequence[int]) -> Any:
        return self.armed.around("d2h", lambda: self.inner.d2h(src, dst))

    def h2d(self, src: Sequence[int], dst: Sequence[int], layer_events: Sequence[Any] | None = None) -> Any:
        return self.armed.around("h2d", lambda: self.inner.h2d(src, dst, layer_events=layer_events))


@pytest.fixture
def armed(monkeypatch: pytest.MonkeyPatch) -> Iterator[Armed]:
    switch = Armed()
    real = StoreMover._submit

    def submit(self: StoreMover, op: str, *args: Any, **kw: Any) -> Any:
        return switch.around("h2s" if op == "write" else "s2h", lambda: real(self, op, *args, **kw))  # type: ignore[arg-type]

    monkeypatch.setattr(StoreMover, "_submit", submit)
    yield switch


def make(armed: Armed, tmp_path: Any, deadline_s: float = 10.0) -> HiCache:
    config = HiCacheConfig(
        GEOMETRY,
        l1_pages=5,  # one prompt's 4 pages: each next prompt evicts the last from L1
        l2_pages=8,  # three prompts' 9 full pages: the third evicts the first from L2
        l3_pages=16,
        device="cpu",
        policy="always",
        storage_path=str(tmp_path / "l3.bin"),
        storage_deadline_s=deadline_s,
    )
    return HiCache(config, mover=lambda cache: Mover(cache, armed))


def content(prompt: list[int], pages: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(tuple(prompt)) % 2**31)
    shape = (GEOMETRY.num_layers, 2, pages, PS, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    return torch.randn(shape, generator=g)


def serve(cache: HiCache, prompt: list[int]) -> int:
    """Admit, restore, check the prefix's bytes, compute the rest; the cached length."""
    req = cache.admit(prompt)
    try:
        cache.restore(req)
        full = len(prompt) // PS
        want = content(prompt, full)
        have = cache.prefix_pages(req)
        got = cache.l1.buffer[:, :, have]
        assert torch.equal(got.view(torch.uint8), want[:, :, : len(have)].contiguous().view(torch.uint8))
        pages = cache.allocate(req, -(-len(prompt) // PS) - len(have))
        assert pages is not None
        cache.l1.buffer[:, :, pages[: full - len(have)]] = want[:, :, len(have) :]
        cache.insert(req, pages[: full - len(have)])
        return len(have) * PS
    finally:
        cache.release(req)


def nothing_held(cache: HiCache) -> None:
    cache.drain()
    cache.check_integrity()
    st = cache.status()
    assert st.requests == 0 and st.core.leases == 0
    assert not any(st.core.transfers_in_flight.values())
    for tier in st.core.tiers:
        assert (tier.protected, tier.in_flight, tier.private) == (0, 0, 0), tier
        assert tier.free + tier.evictable == tier.capacity, tier


@pytest.mark.parametrize("after", [False, True], ids=["before-issue", "after-issue"])
@pytest.mark.parametrize("call", ["d2h", "h2s", "s2h", "h2d"])
def test_an_interrupt_while_a_copy_is_issued_fails_that_copy_only(
    call: str, after: bool, armed: Armed, tmp_path: Any
) -> None:
    cache = make(armed, tmp_path)
    before = {"d2h": [], "h2s": [], "h2d": [A, B], "s2h": [A, B, C]}[call]
    for prompt in before:  # A leaves L1 (and, for S2H, L2 too)
        serve(cache, prompt)
        cache.drain()
    armed.arm(call, after)
    with pytest.raises(KeyboardInterrupt):  # a backup's in the insert or in the drain after it
        serve(cache, A)
        cache.drain()
    assert armed.fired == 1
    nothing_held(cache)
    for prompt in (A, B, C, A):  # the pages handed back afterwards are the pages written
        serve(cache, prompt)
        nothing_held(cache)
    cache.close()


def test_a_transfer_no_job_will_end_is_reported(armed: Armed, tmp_path: Any) -> None:
    """The check that catches such a leak: a transfer in flight in the core that no job of
    the controller tracks (here started behind the controller's back)."""
    cache = make(armed, tmp_path)
    serve(cache, A)
    cache.drain()
    core = cache.controller.core
    node = next(n for n in core.tree.iter_nodes() if n.parent is not None)
    core.evict_node(node, Tier.L1)
    transfer = core.start(Direction.H2D, node)
    assert transfer is not None
    with pytest.raises(IntegrityError, match="no job will ever end"):
        cache.check_integrity()
    core.fail(transfer)
    cache.check_integrity()
    cache.close()


# -- a real Ctrl-C inside the bookkeeping ---------------------------------------------------

CORE_STEPS = (
    "allocate_l1",
    "free_private",
    "lock",
    "release",
    "adopt",
    "start",
    "complete",
    "fail",
    "evict_node",
    "ensure_free",
)


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler for the test (a test runner may have its own), put back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("python_sigint")
@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("step", CORE_STEPS)
def test_ctrl_c_inside_the_bookkeeping_lands_when_the_call_returns(
    step: str, nth: int, armed: Armed, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGINT raised right after the core's ``step`` (its ``nth`` call) reaches the caller
    as KeyboardInterrupt once the cache call around it has finished: nothing is half-done,
    so releasing what the caller holds frees everything, and every page served afterwards
    is the page written."""
    cache = make(armed, tmp_path)
    interrupted, calls = signal_in_the_bookkeeping(cache, monkeypatch, step, nth, signal.SIGINT, KeyboardInterrupt)
    assert interrupted == (1 if calls >= nth else 0)
    cache.close()


def signal_in_the_bookkeeping(
    cache: HiCache, monkeypatch: pytest.MonkeyPatch, step: str, nth: int, signum: int, raised: type[BaseException]
) -> tuple[int, int]:
    """Serve prompts with ``signum`` raised right after the ``nth`` call of the core's
    ``step``, releasing what a ``raised`` out of a call cut short (as an engine does), with
    nothing held after each; then serve again without it, every page the page written.
    Returns (``raised`` caught, the step's calls)."""
    core = cache.controller.core
    real = getattr(core, step)
    calls = [0]

    def then_signal(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == nth:
            signal.raise_signal(signum)
        return out

    monkeypatch.setattr(core, step, then_signal)
    caught = 0
    for prompt in (A, B, C, A, B):
        try:
            serve(cache, prompt)
            cache.drain()
        except raised:
            caught += 1
            for req in cache.requests():  # what an engine does with the requests it cut short
                cache.release(req)
        nothing_held(cache)
    monkeypatch.setattr(core, step, real)
    for prompt in (A, B, C, A):
        serve(cache, prompt)
        nothing_held(cache)
    return caught, calls[0]


def stands_for(handler: object) -> object:
    """The handler SIGINT reaches: through a cache's forwarder, the one it stands in for."""
    return getattr(handler, "before", handler)


def _sigint_inside_insert(cache: HiCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve A with a SIGINT raised inside insert's bookkeeping (after the core adopts the pages)."""
    core = cache.controller.core
    real = core.adopt

    def adopt_then_sigint(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(core, "adopt", adopt_then_sigint)
    serve(cache, A)


@pytest.mark.usefixtures("python_sigint")
def test_a_handler_of_the_callers_gets_the_sigint_when_the_call_returns(
    armed: Armed, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's own SIGINT handler runs once, after the cache call, not inside it; once
    the last cache closes, SIGINT's handler is the engine's again."""
    seen: list[int] = []

    def mine(signum: int, frame: object) -> None:
        seen.append(len(cache.requests()))  # after insert returned, before release

    signal.signal(signal.SIGINT, mine)
    others = interrupts._Held.users  # caches other tests left open hold it too
    cache = make(armed, tmp_path)
    _sigint_inside_insert(cache, monkeypatch)
    assert seen == [1]
    nothing_held(cache)
    cache.close()
    assert stands_for(signal.getsignal(signal.SIGINT)) is mine
    assert not others or signal.getsignal(signal.SIGINT) is not mine  # others hold it still


@pytest.mark.usefixtures("python_sigint")
def test_an_ignored_sigint_stays_ignored(armed: Armed, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    others = interrupts._Held.users
    cache = make(armed, tmp_path)
    _sigint_inside_insert(cache, monkeypatch)
    nothing_held(cache)
    cache.close()
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # never replaced: children inherit it
    del others


def test_a_cache_collected_unclosed_lets_go_of_sigint(armed: Armed, tmp_path: Any) -> None:
    """Forgetting close() does not leave the forwarder in place for good."""
    import gc

    before = interrupts._Held.users
    cache = make(armed, tmp_path)
    assert interrupts._Held.users == before + (threading.current_thread() is threading.main_thread())
    cache.controller.close()  # its storage, so the collection warns of nothing else
    assert interrupts._Held.users == before
    cache = make(armed, tmp_path)
    cache.controller.storage.close()  # type: ignore[union-attr]
    del cache
    gc.collect()
    assert interrupts._Held.users == before


@pytest.mark.usefixtures("python_sigint")
def test_a_cache_of_another_thread_leaves_sigint_alone(armed: Armed, tmp_path: Any) -> None:
    """Only the main thread runs signal handlers: a cache built elsewhere changes nothing."""
    handlers: list[object] = []

    def build() -> None:
        cache = make(armed, tmp_path)
        handlers.append(signal.getsignal(signal.SIGINT))
        cache.close()

    t = threading.Thread(target=build)
    t.start()
    t.join(60)
    assert handlers == [signal.default_int_handler]


@pytest.mark.usefixtures("python_sigint")
def test_a_forwarder_put_back_after_the_caches_closed_still_reaches_its_handler(armed: Armed, tmp_path: Any) -> None:
    """``old = signal.signal(SIGINT, h)`` while a cache is open saves its forwarder; put back
    after the cache closed, Ctrl-C still raises KeyboardInterrupt (it was swallowed)."""
    cache = make(armed, tmp_path)
    old = signal.signal(signal.SIGINT, lambda signum, frame: None)
    cache.close()
    signal.signal(signal.SIGINT, old)
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


@pytest.mark.usefixtures("python_sigint")
def test_a_handler_put_back_while_another_cache_opened_is_the_one_reached(armed: Armed, tmp_path: Any) -> None:
    """Cache A open; a handler set for a while, cache B opened meanwhile, the saved handler
    put back: Ctrl-C reaches Python's own again, not the one set for a while."""
    first = make(armed, tmp_path)
    saved = signal.signal(signal.SIGINT, lambda signum, frame: None)
    (tmp_path / "b").mkdir()
    second = make(armed, tmp_path / "b")
    signal.signal(signal.SIGINT, saved)
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    second.close()
    first.close()


@pytest.mark.usefixtures("python_sigint")
def test_a_mover_blocked_while_issuing_a_copy_can_be_interrupted(
    armed: Armed, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while a mover issues a copy (an embedder's mover may block there) raises at
    once, inside the mover, not when the cache call returns; that transfer fails, nothing
    stays held, and what is served afterwards is what was written."""
    cache = make(armed, tmp_path)
    for prompt in (A, B):
        serve(cache, prompt)
        cache.drain()
    mover = cache.controller.device
    real = mover.h2d
    after_the_signal: list[int] = []

    def blocked(*args: Any, **kwargs: Any) -> Any:
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while it waits
        after_the_signal.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mover, "h2d", blocked)
    with pytest.raises(KeyboardInterrupt):
        serve(cache, A)
    assert after_the_signal == []
    for req in cache.requests():
        cache.release(req)
    nothing_held(cache)
    monkeypatch.setattr(mover, "h2d", real)
    for prompt in (A, B, C, A):
        serve(cache, prompt)
        nothing_held(cache)
    cache.close()


class Timeout(Exception):
    """What a timeout's signal handler raises (``signal.alarm`` and a handler that raises)."""


_OTHER_SIGNALS = [getattr(signal, n) for n in ("SIGALRM", "SIGTERM", "SIGUSR1") if hasattr(signal, n)]


@pytest.mark.parametrize("signum", _OTHER_SIGNALS, ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("step", CORE_STEPS)
def test_a_signal_handler_that_raises_inside_the_bookkeeping_raises_when_the_call_returns(
    signum: int, step: str, armed: Armed, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Python handler of another signal than SIGINT (a timeout's SIGALRM, a SIGTERM that
    exits) that raises is held like Ctrl-C: its exception comes out of the cache call once
    the call has done all it does, nothing stays held once the caller releases what it has,
    every page served afterwards is the page written, and the handler is the caller's again
    once the cache closes."""
    raised: list[int] = []

    def timeout(sig: int, frame: object) -> None:
        raised.append(sig)
        raise Timeout

    before = signal.signal(signum, timeout)
    try:
        cache = make(armed, tmp_path)
        timeouts, calls = signal_in_the_bookkeeping(cache, monkeypatch, step, 1, signum, Timeout)
        assert timeouts == len(raised) == (1 if calls else 0)
        cache.close()
        assert signal.getsignal(signum) is timeout or interrupts._Held.users  # others' caches hold it
    finally:
        signal.signal(signum, before)


def test_a_signal_at_its_default_action_or_ignored_is_left_alone(armed: Armed, tmp_path: Any) -> None:
    """Only Python handlers of the other signals are held: a signal at its default action
    (it ends the process: nothing to raise) or ignored keeps its handler."""
    if not hasattr(signal, "SIGUSR2") or not hasattr(signal, "SIGHUP"):
        pytest.skip("no SIGUSR2 / SIGHUP here")
    before = signal.signal(signal.SIGUSR2, signal.SIG_DFL), signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        cache = make(armed, tmp_path)
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        cache.close()
    finally:
        signal.signal(signal.SIGUSR2, before[0])
        signal.signal(signal.SIGHUP, before[1])


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="no SIGALRM here")
@pytest.mark.parametrize("wait_in", ["restore", "drain"])
def test_a_timeout_while_the_cache_waits_for_a_copy_reaches_the_caller(
    wait_in: str, armed: Armed, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking wait (``restore``, ``drain``) is not held: a SIGALRM handler's exception
    raised while it waits for a ticket reaches the caller at once, and is not taken for the
    ticket's failure (which would fail a copy that is fine, and swallow the timeout). The
    copy then lands as usual: nothing is lost, and every page served is the page written."""
    from hicache.backends.ticket import Ticket

    def timeout(signum: int, frame: object) -> None:
        raise Timeout

    before = signal.signal(signal.SIGALRM, timeout)
    try:
        # NOTE: the write held below must not reach its deadline on a loaded machine (failed
        # there, it is no longer waited for: drain() would have nothing to wait on)
        cache = make(armed, tmp_path, deadline_s=3600.0)
        for prompt in (A, B):
            serve(cache, prompt)
            cache.drain()
        real = Ticket.wait
        fired = [0]

        def wait_then_signal(self: Ticket) -> bool:
            if not fired[0]:
                fired[0] = 1
                signal.raise_signal(signal.SIGALRM)
            return real(self)

        req = cache.admit(A) if wait_in == "restore" else None
        if req is not None:
            assert req.hit[1] > 0  # in L2, not in L1: restore() waits for its H2D
        else:
            # NOTE: its backup to L3 hangs until released: drain() has a copy to wait for
            # whatever the machine's speed (the write could land before drain was called)
            cache.faults.add("hang", op="write")
            serve(cache, C)
            for _ in range(3_000):  # bounded: until the write is issued and held (polls issue it)
                cache.poll()
                if cache.faults.hanging:
                    break
                threading.Event().wait(0.01)
            assert cache.faults.hanging == 1
        monkeypatch.setattr(Ticket, "wait", wait_then_signal)
        with pytest.raises(Timeout):
            if req is not None:
                cache.restore(req)
            else:
                cache.drain()
        assert fired[0] == 1
        cache.faults.release()
        monkeypatch.setattr(Ticket, "wait", real)
        if req is not None:
            cache.release(req)
        nothing_held(cache)
        assert all(d["failed"] == 0 for d in cache.status().metrics["directions"].values())
        for prompt in (A, B, C, A):
            serve(cache, prompt)
            nothing_held(cache)
        cache.close()
    finally:
        signal.signal(signal.SIGALRM, before)


@pytest.mark.parametrize("after", [False, True], ids=["before-issue", "after-issue"])
def test_an_interrupt_while_the_h2d_after_a_landed_read_is_issued_fails_the_restore(
    after: bool, armed: Armed, tmp_path: Any
) -> None:
    """The H2D of an L3 restore is issued inside ``poll`` once its read has landed; an
    interrupt there reaches the caller, and the restore fails (reported by a later poll, the
    request recomputes) instead of waiting for good on a copy that no job will ever end."""
    cache = make(armed, tmp_path)
    for prompt in (A, B, C):  # A leaves L1 and L2: only L3 has it
        serve(cache, prompt)
        cache.drain()
    req = cache.admit(A)
    assert req.hit[1] == 0 and req.hit[2] > 0
    pending = cache.start_restore(req)
    assert pending is not None and pending.transfer is not None and pending.transfer.direction is Direction.S2H
    armed.arm("h2d", after)
    caught, reported = 0, []
    for _ in range(10_000):  # bounded: the read of a few pages lands in milliseconds
        try:
            reported = cache.poll()
        except KeyboardInterrupt:
            caught += 1
            continue
        if reported or (caught and pending.finished):
            break
        threading.Event().wait(0.001)
    assert armed.fired == caught == 1
    assert reported == [pending] and pending.finished and not pending.done
    cache.check_integrity()
    assert cache.poll() == []  # reported once
    want = content(A, len(A) // PS)
    pages = cache.allocate(req, -(-len(A) // PS) - req.cached_len // PS)  # it recomputes
    assert pages is not None
    cache.l1.buffer[:, :, pages[: len(A) // PS]] = want
    cache.insert(req, pages[: len(A) // PS])
    cache.release(req)
    nothing_held(cache)
    for prompt in (A, B, C, A):  # the pages handed back afterwards are the pages written
        serve(cache, prompt)
        nothing_held(cache)
    cache.close()


def release_with_signals(cache: HiCache, signums: Sequence[int]) -> None:
    """Serve A, admit it again and release it with ``signums`` raised, in order, right after
    the core gave the request's lease back (inside the atomic release)."""
    serve(cache, A)
    cache.drain()
    core = cache.controller.core
    real = core.release

    def release_then_signals(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        for signum in signums:
            signal.raise_signal(signum)
        return out

    req = cache.admit(A)
    core.release = release_then_signals  # type: ignore[method-assign]
    try:
        cache.release(req)
    finally:
        core.release = real  # type: ignore[method-assign]


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
@pytest.mark.usefixtures("python_sigint")
def test_a_signal_held_beside_a_ctrl_c_reaches_its_handler_with_it(armed: Armed, tmp_path: Any) -> None:
    """Ctrl-C and another signal inside one atomic call: Ctrl-C's KeyboardInterrupt comes
    out of the call and the other's handler has run too, not at a later call's end (or, the
    caller closing on Ctrl-C, never: held by a cache gone, fired into a later one)."""
    seen: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        cache = make(armed, tmp_path)
        with pytest.raises(KeyboardInterrupt):
            release_with_signals(cache, (signal.SIGINT, signal.SIGUSR1))
        for _ in range(100):  # the handler runs between two bytecodes: at once, in practice
            if seen:
                break
        assert seen == [signal.SIGUSR1] and not interrupts._Held.came
        nothing_held(cache)
        cache.close()
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
@pytest.mark.usefixtures("python_sigint")
def test_every_signal_held_reaches_its_handler_when_two_handlers_raise(armed: Armed, tmp_path: Any) -> None:
    """Ctrl-C, then a SIGTERM whose handler raises too, then SIGUSR1 in one atomic call: the
    third's handler runs as well (the signals go back to the OS together, so one handler
    raising does not keep the next from being raised)."""

    class Term(Exception):
        pass

    seen: list[str] = []

    def term(signum: int, frame: object) -> None:
        seen.append("TERM")
        raise Term

    usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append("USR1"))
    before = usr1, signal.signal(signal.SIGTERM, term)
    try:
        cache = make(armed, tmp_path)
        with pytest.raises((KeyboardInterrupt, Term)):
            release_with_signals(cache, (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1))
        for _ in range(100):  # a handler still tripped runs at the next check: at once, in practice
            try:
                if sorted(seen) == ["TERM", "USR1"]:
                    break
            except Term:
                pass
        assert sorted(seen) == ["TERM", "USR1"] and not interrupts._Held.came
        nothing_held(cache)
        cache.close()
    finally:
        signal.signal(signal.SIGUSR1, before[0])
        signal.signal(signal.SIGTERM, before[1])


def test_an_interrupt_while_room_is_made_for_a_copy_leaves_no_pin(tmp_path: Any) -> None:
    """write_back: a restore's H2D makes room by backing up an L1 victim first; a Ctrl-C while
    that backup is issued reaches the caller, and the pins the H2D had taken are given back."""
    geometry = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, dtype=torch.float32)
    config = HiCacheConfig(
        geometry, l1_pages=4, l2_pages=8, device="cpu", transfer_backend="torch", write_policy="write_back",
        policy="always",
    )  # fmt: skip
    switch = Armed()
    cache = HiCache(config, mover=lambda c: Mover(c, switch))
    b, a = [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    for prompt in (b, a):  # a's pages push b's out of L1 (backed up to L2 first: write_back)
        req = cache.admit(prompt)
        pages = cache.allocate(req, 4)
        assert pages is not None
        cache.l1.buffer[:, :, pages] = float(prompt[0])
        cache.insert(req, pages)
        cache.release(req)
    cache.drain()
    req = cache.admit(b)
    assert req.hit == (0, 8, 0)
    switch.arm("d2h", after=False)  # the victim's (a's) backup, issued to make room for b's H2D
    with pytest.raises(KeyboardInterrupt):
        cache.restore(req)
    assert switch.fired == 1
    cache.release(req)
    nothing_held(cache)
    cache.close()


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="no SIGALRM here")
@pytest.mark.parametrize("read", ["available", "status"])
def test_a_timeout_while_the_store_is_asked_during_an_issue_reaches_the_caller(read: str) -> None:
    """Issuing an L3 copy asks the store whether it is available (and, when not, its status):
    a timeout's SIGALRM handler that raises meanwhile is the caller's, not a store that
    raised: it reaches the caller (it was logged as ``available raised`` and the copy failed
    as "store unavailable", the timeout lost), and nothing stays held."""
    import sys

    from hicache.testing.memory_store import MemoryStore

    def issuing() -> bool:  # NOTE: whether the mover is issuing a copy (its _submit) up the stack
        frame: Any = sys._getframe(1)
        names = set()
        for _ in range(5):
            frame = frame.f_back if frame is not None else None
            names.add(frame.f_code.co_name if frame is not None else "")
        return "_submit" in names

    class Asked(MemoryStore):
        fire = False

        @property
        def available(self) -> bool:
            self._maybe_fire("available")
            return read != "status" or not issuing()  # status: down once the copy is issued

        def status(self) -> dict[str, Any]:
            self._maybe_fire("status")
            return {"error": "down"}

        def _maybe_fire(self, what: str) -> None:
            if Asked.fire and what == read and issuing():
                Asked.fire = False
                signal.raise_signal(signal.SIGALRM)

    def timeout(signum: int, frame: object) -> None:
        raise Timeout

    before = signal.signal(signal.SIGALRM, timeout)
    try:
        config = HiCacheConfig(
            GEOMETRY, l1_pages=8, l2_pages=8, l3_pages=16, policy="always", device="cpu", model_id="m"
        )
        cache = HiCache(config, store=lambda host: Asked(host))
        try:
            req = cache.admit(A)
            pages = cache.allocate(req, len(A) // PS)
            assert pages is not None
            Asked.fire = True
            with pytest.raises(Timeout):
                cache.insert(req, pages)  # the D2H lands at once on CPU: its landing issues the H2S
                cache.release(req)
                cache.drain()
            assert not Asked.fire  # it fired, in the issue
            assert cache.storage is not None and cache.storage.counts["available_raised"] == 0
            for r in cache.controller.requests():
                cache.release(r)
            nothing_held(cache)
        finally:
            cache.close()
    finally:
        signal.signal(signal.SIGALRM, before)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, Timeout], ids=["ctrl-c", "a-handlers-timeout"])
def test_an_interrupt_as_the_issued_h2d_is_handed_back_waits_for_its_copy_first(
    armed: Armed, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, interrupt: type[BaseException]
) -> None:
    """An interrupt that comes as the mover hands back an H2D it issued (the end of the
    interruptible stretch) fails that transfer: its L1 pages go back to the pool, where the
    engine's next forward on them is ordered by no fence, so the copy is waited for first
    (on a GPU it could still land over that forward's pages). Then all is as before. The
    same for a signal handler's exception that is an Exception (a timeout's)."""
    from contextlib import contextmanager

    from hicache.core import controller as controller_module

    cache = make(armed, tmp_path)
    try:
        for prompt in (A, B):
            serve(cache, prompt)
            cache.drain()
        mover = cache.controller.device
        real_h2d, real_interruptible = mover.h2d, interrupts.interruptible
        issued: list[Any] = []
        waited: list[bool] = []

        def h2d(src: Sequence[int], dst: Sequence[int], layer_events: Sequence[Any] | None = None) -> Any:
            ticket = real_h2d(src, dst, layer_events=layer_events)
            real_wait = ticket.wait

            def wait() -> bool:  # whether its pages were still its own when it was waited for
                waited.append(not set(dst) & set(cache.controller.core.l1.free_pages()))
                return bool(real_wait())

            ticket.wait = wait  # type: ignore[method-assign]
            issued.append(ticket)
            return ticket

        @contextmanager
        def interrupted_as_it_ends() -> Iterator[None]:
            with real_interruptible():
                yield
            if len(issued) == 1 and not waited:
                exc = interrupt()
                interrupts._Held.raised = exc  # NOTE: as a held signal's handler raising does
                raise exc  # as a Ctrl-C lands between two bytecodes

        with monkeypatch.context() as patched:
            patched.setattr(mover, "h2d", h2d)
            patched.setattr(controller_module, "interruptible", interrupted_as_it_ends)
            req = cache.admit(A)
            assert req.hit[1] > 0  # in L2, not in L1: restore() issues an H2D
            with pytest.raises(interrupt):
                cache.restore(req)
            assert len(issued) == 1 and waited == [True]
            cache.release(req)
        nothing_held(cache)
        for prompt in (A, B, C, A):
            serve(cache, prompt)
        nothing_held(cache)
    finally:
        cache.close()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
def test_a_signal_that_comes_as_an_atomic_call_ends_lets_the_held_ones_go_first(armed: Armed, tmp_path: Any) -> None:
    """A signal that comes once an atomic call has stopped holding, before it delivered what
    it held, goes after the held ones; its handler raising does not keep them back (they
    waited for some later call's end)."""
    got: list[int] = []

    def noted(signum: int, frame: object) -> None:
        got.append(signum)

    def timeout(signum: int, frame: object) -> None:
        got.append(signum)
        raise Timeout

    before = signal.signal(signal.SIGUSR2, noted), signal.signal(signal.SIGUSR1, timeout)
    try:
        cache = make(armed, tmp_path)
        try:
            interrupts._Held.depth = 1  # inside an atomic call: SIGUSR2 is held
            signal.raise_signal(signal.SIGUSR2)
            assert got == [] and list(interrupts._Held.came) == [signal.SIGUSR2]
            interrupts._Held.depth = 0  # its end has stopped holding, not delivered yet
            with pytest.raises(Timeout):
                signal.raise_signal(signal.SIGUSR1)
            assert got == [signal.SIGUSR2, signal.SIGUSR1] and not interrupts._Held.came
        finally:
            interrupts._Held.depth = 0
            interrupts._Held.came.clear()
            cache.close()
    finally:
        signal.signal(signal.SIGUSR2, before[0])
        signal.signal(signal.SIGUSR1, before[1])
