"""Layer signals (hicache.engine.signals) and the engine's signalled restore, on CPU.

The device's value waits are replaced by a log of writes and waits, so the protocol can be
checked where it is decided, on the host: per round every group's signal is written exactly
once whatever fails (a forward or a drain waiting on one never written would hang the GPU;
one written twice could outlive the reset and let the next forward read pages before they
land), and each round is consumed exactly once, by the forward or by a drain. The engine's
layered restore runs its whole signalled path here (deferred H2D, forward launched first,
flush, end of round) and must give the logits of the L1 hit."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch

from hicache.backends.transfer import TransferEngine
from hicache.engine import Engine
from hicache.engine import engine as engine_module
from hicache.engine.signals import LayerSignals
from hicache.errors import MisuseError
from hicache.spec.model import Tier
from tests.engine.test_engine import engine

GROUPS = [(0, 1), (1, 2)]  # the tiny model's two layers, one group each


class Log:
    """The device side, faked: the value writes and waits queued, by round."""

    def __init__(self) -> None:
        self.round = 0
        self.writes: list[tuple[int, int]] = []  # (round, group)
        self.waits: list[tuple[int, int]] = []
        self.resets: list[int] = []  # the round of each reset
        self.signals: LayerSignals | None = None

    def write(self, stream: object, addr: int, value: int) -> None:
        assert value == 1 and self.signals is not None
        self.writes.append((self.round, self._group(addr)))
        self.signals.flags[self._group(addr)] = value

    def wait(self, stream: object, addr: int, value: int) -> None:
        self.waits.append((self.round, self._group(addr)))

    def _group(self, addr: int) -> int:
        assert self.signals is not None
        return (addr - self.signals.flags.data_ptr()) // 4


def fake_signals(groups: list[tuple[int, int]] = GROUPS) -> tuple[LayerSignals, Log]:
    log = Log()
    signals = LayerSignals(groups, torch.device("cpu"), write=log.write, wait_for=log.wait)
    log.signals = signals
    real_arm = signals.arm

    def arm() -> None:
        log.round += 1
        real_arm()

    real_reset = signals.reset

    def reset(stream: Any = None) -> None:
        log.resets.append(log.round)
        real_reset(stream)

    signals.arm = arm  # type: ignore[method-assign]
    signals.reset = reset  # type: ignore[method-assign]
    return signals, log


def test_one_object_per_layer_and_a_groups_layers_share_it() -> None:
    signals, _ = fake_signals([(0, 1), (1, 3), (3, 4)])
    assert len(signals.events) == 4
    assert [e.group for e in signals.events] == [0, 1, 1, 2]
    assert signals.events[1] is signals.events[2]


def any_recorded(signals: LayerSignals) -> bool:
    return signals.recorded_any


def all_recorded(signals: LayerSignals) -> bool:
    return signals.recorded_all


def test_a_signal_is_written_once_per_round_and_fill_writes_only_the_rest() -> None:
    signals, log = fake_signals([(0, 1), (1, 2), (2, 3)])
    signals.arm()
    assert not any_recorded(signals)
    signals.events[1].record("copy")
    signals.events[1].record("copy")  # a second record in the round: not written
    assert any_recorded(signals) and not all_recorded(signals) and signals.ignored == 1
    assert signals.fill("fill") == 2
    assert all_recorded(signals) and signals.fill("fill") == 0
    assert sorted(log.writes) == [(1, 0), (1, 1), (1, 2)]
    signals.arm()  # a new round: each may be written again, once
    signals.fill()
    assert Counter(g for r, g in log.writes if r == 2) == Counter({0: 1, 1: 1, 2: 1})


def test_wait_all_waits_on_every_group() -> None:
    signals, log = fake_signals([(0, 2), (2, 3)])
    signals.wait_all("side")
    assert log.waits == [(0, 0), (0, 1)]


def signalled(
    e: Engine,
    monkeypatch: pytest.MonkeyPatch,
    fail: list[BaseException] | None = None,
    *,
    replays: bool = True,
    order: bool = True,
) -> tuple[Log, list[bool], list[bool]]:
    """Turn on ``e``'s signalled layered restore with faked value operations; returns the
    log, the ``consumed`` of each end of round, and whether each layered forward returned.
    A layered forward raises the next exception in ``fail``, if any. ``replays``: whether
    the runner says a layered forward replays a captured graph (on CPU none is captured);
    ``order``: check that it is launched once the first group's copy is queued."""
    signals, log = fake_signals()
    device = e.cache.device
    assert isinstance(device, TransferEngine)
    device.layer_group = device.last_layer_group = 1  # its copy's groups are the signals' (GROUPS)
    assert device.layer_groups() == GROUPS
    e.layered = True
    e.runner.signals, e.runner.layer_events = signals, signals.events
    ends: list[bool] = []
    forwards: list[bool] = []
    end_round = e.runner.end_round

    def end(*, consumed: bool) -> None:
        ends.append(consumed)
        end_round(consumed=consumed)
        assert signals.recorded_all  # the round's every signal is written by now

    forward = e.runner.forward

    def fwd(seqs: Any, *, layered: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
        if layered:  # a replay is launched once the first group is queued, else after all
            assert not order or signals._recorded == ([True, False] if replays else [True, True])
            # a forward that may wait on the host for the GPU (a capture, an eager forward)
            # starts only once every signal is written, even over a failed copy
            assert replays or all_recorded(signals)
            assert (into is not None) == replays  # a replay allocates nothing: its target is made before
            forwards.append(False)
            if fail:
                raise fail.pop(0)
            out = forward(seqs, layered=layered, into=into)
            forwards[-1] = True
            return out
        return forward(seqs, layered=layered)

    def target(seqs: Any, *, layered: bool = False) -> torch.Tensor | None:
        return torch.empty(1, 1) if replays and layered else None

    monkeypatch.setattr(e.runner, "replay_target", target)
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))  # its per-group records, on CPU
    monkeypatch.setattr(engine_module, "FORWARD_AFTER_GROUPS", 1)
    monkeypatch.setattr(e.runner, "end_round", end)
    monkeypatch.setattr(e.runner, "forward", fwd)
    return log, ends, forwards


def same_logits(out: Any, ref: Any) -> bool:
    return (
        out.first_logits is not None
        and ref.first_logits is not None
        and torch.equal(out.first_logits, ref.first_logits)
    )


def each_round_written_once(log: Log, *, at_launch: bool = False) -> None:
    """Every group written exactly once per round, and none by :meth:`LayerSignals.fill`
    ahead of the producer (its own records would then come second, ignored: the flag would
    say "landed" before the pages had); every round consumed: its flags zeroed. On CPU a
    consumer runs at its launch, not after its waits: one launched mid-copy (``at_launch``)
    zeroes them before the last writes, so there each round's reset is only counted."""
    assert log.signals is not None and log.signals.ignored == 0
    rounds = {r for r, _ in log.writes}
    assert rounds <= set(log.resets), f"rounds {sorted(rounds)}, resets {log.resets}"
    if not at_launch:
        assert not torch.count_nonzero(log.signals.flags), "a round left unconsumed: its flags not zeroed"
    per = Counter(log.writes)
    assert set(per.values()) <= {1}, per
    for r in {r for r, _ in log.writes}:
        assert {g for rr, g in log.writes if rr == r} == {0, 1}


def scene(seed: int) -> tuple[list[int], Any, Any]:
    """A prompt of 10 pages and a tail; and the references: its output as an L1 hit, and
    computed whole (what a request whose restore failed computes)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(200) for _ in range(43)]
    ref = engine()
    cold = ref.generate(prompt, max_new_tokens=3)
    ref.close()
    ref = engine()
    ref.generate(prompt[:40])
    hit = ref.generate(prompt, max_new_tokens=3)
    assert hit.restored_from == "L1" and cold.cached_tokens == 0
    ref.close()
    return prompt, hit, cold


def drop_l1(e: Engine) -> None:
    """Every page of ``e``'s tree leaves L1 (its L2 copy stays)."""
    e.cache.drain()
    e.cache.core.evict(Tier.L1, 10**6)


def prefix_in_l2(e: Engine, prompt: list[int]) -> None:
    """``prompt``'s 10-page prefix computed, then only in L2."""
    e.generate(prompt[:40])
    drop_l1(e)


def from_l2(e: Engine, prompt: list[int], *, scramble: bool = False) -> Any:
    """``prompt`` served after its 10-page prefix left L1 for L2; ``scramble``: the L1 pool
    is noise first, so a forward that read a page before its copy gives other logits."""
    prefix_in_l2(e, prompt)
    if scramble:
        e.cache.l1.buffer.normal_()
    return e.generate(prompt, max_new_tokens=3)


@pytest.mark.parametrize("replays", [True, False], ids=["replay-first", "capture-after-copies"])
def test_a_signalled_layered_restore_gives_the_l1_hits_logits(monkeypatch: pytest.MonkeyPatch, replays: bool) -> None:
    """The forward is launched before the copies are queued when it replays a captured
    graph; a forward that would capture one (a capture synchronizes the device) or run
    eagerly is launched after them, or its host would wait for copies never queued.
    (On CPU a forward runs at its launch: launched first, it reads the pages L1 still holds;
    so only the capture case scrambles L1. The GPU tests check a replay over garbage.)"""
    prompt, hit, _ = scene(1)
    e = engine()
    log, ends, forwards = signalled(e, monkeypatch, replays=replays)
    out = from_l2(e, prompt, scramble=not replays)
    assert out.restored_from == "L2" and e.stats.layered_used == 1
    assert forwards == [True] and ends == [True]
    each_round_written_once(log, at_launch=replays)
    assert same_logits(out, hit) and out.tokens == hit.tokens
    e.cache.check_integrity()
    e.close()


def test_without_room_for_its_pages_the_round_is_drained(monkeypatch: pytest.MonkeyPatch) -> None:
    """No L1 pages for the forward's tail: no forward, the round is consumed by a drain
    (its waits on both groups), and the request prefills after its restore as usual."""
    prompt, hit, _ = scene(2)
    e = engine()
    log, ends, forwards = signalled(e, monkeypatch)
    prefix_in_l2(e, prompt)
    allocate = e.cache.allocate
    refused = {"n": 0}

    def no_room_once(req: Any, n: int) -> Any:
        if not refused["n"]:
            refused["n"] += 1
            return None
        return allocate(req, n)

    monkeypatch.setattr(e.cache, "allocate", no_room_once)
    out = e.generate(prompt, max_new_tokens=3)
    assert refused["n"] == 1 and forwards == [] and ends == [False]
    assert log.waits[-2:] == [(1, 0), (1, 1)]  # the drain
    each_round_written_once(log)
    assert out.restored_from == "L2" and e.stats.layered_used == 0
    assert same_logits(out, hit) and out.tokens == hit.tokens
    e.close()


def test_a_forward_that_raises_leaves_its_round_drained_and_the_engine_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt, hit, _ = scene(3)
    e = engine()
    fail: list[BaseException] = [torch.OutOfMemoryError("no memory for the layered forward")]
    log, ends, forwards = signalled(e, monkeypatch, fail)
    prefix_in_l2(e, prompt)
    rid = e.submit(prompt, 3)
    outs = {o.id: o for o in e.run()}
    assert not fail and forwards == [False] and ends == [False]
    assert outs[rid].error is not None  # that request failed, nothing raised out of step()
    each_round_written_once(log)
    drop_l1(e)
    out = e.generate(prompt, max_new_tokens=3)  # the engine goes on: served exactly
    assert out.restored_from == "L2" and e.stats.layered_used == 1
    assert forwards == [False, True] and ends == [False, True]
    each_round_written_once(log, at_launch=True)
    assert same_logits(out, hit)
    e.cache.check_integrity()
    e.close()


@pytest.mark.parametrize("replays", [True, False], ids=["replay-first", "capture-after-copies"])
def test_an_h2d_that_cannot_be_queued_fills_the_round_and_the_request_recomputes(
    monkeypatch: pytest.MonkeyPatch, replays: bool
) -> None:
    """The deferred H2D raises while queued (after the forward's launch): its ticket fails,
    the signals it did not write are filled, the forward consumes the round (on garbage:
    its logits are not used), and the request recomputes the whole prompt."""
    prompt, _, cold = scene(4)
    e = engine()
    log, ends, forwards = signalled(e, monkeypatch, order=False, replays=replays)
    prefix_in_l2(e, prompt)

    def broken(self: TransferEngine, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cudaMemcpyAsync failed")

    for path in ("_issue", "_issue_copy", "_issue_straight"):
        monkeypatch.setattr(TransferEngine, path, broken)
    out = e.generate(prompt, max_new_tokens=3)
    assert forwards == [True] and ends == [True]
    each_round_written_once(log, at_launch=replays)
    assert out.error is None and e.stats.layered_used == 0 and e.stats.restores_failed == 1
    assert same_logits(out, cold) and out.tokens == cold.tokens
    e.cache.check_integrity()
    e.close()


def test_a_refused_restore_writes_no_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    prompt, _, cold = scene(5)
    e = engine()
    log, ends, forwards = signalled(e, monkeypatch)
    prefix_in_l2(e, prompt)
    monkeypatch.setattr(e.cache, "start_restore", lambda *a, **k: None)
    out = e.generate(prompt, max_new_tokens=3)
    assert log.writes == [] and ends == [] and forwards == []
    assert same_logits(out, cold)
    e.close()


def test_only_a_graph_already_captured_counts_as_a_replay() -> None:
    """A forward launched before its copies are queued must not wait on the host for the
    GPU: a capture (it synchronizes the device) or an eager forward is not a replay."""
    e = engine()
    run = e.runner
    pages = list(range(4))
    seqs = [([1, 2, 3], pages, 12)]
    key = (1, 3, -(-15 // run.graph_bucket) * run.graph_bucket, True)

    class Made:
        graph: object = None

    run.graphs_enabled = True  # faked: nothing is captured on CPU
    assert not run.replays(seqs, layered=True)  # no graph for this shape
    run._graphs[key] = Made()  # type: ignore[assignment]
    assert not run.replays(seqs, layered=True)  # made, capture still to come
    Made.graph = object()
    assert run.replays(seqs, layered=True)
    assert not run.replays(seqs, layered=False)  # another graph
    assert not run.replays([(list(range(run.graph_tokens + 1)), pages, 12)], layered=True)  # eager: too long
    assert not run.replays([([1, 2, 3], pages, 0)], layered=True)  # a fresh prefill
    run.graphs_enabled = False
    assert not run.replays(seqs, layered=True)
    e.close()


def test_a_restore_that_raises_after_its_h2d_was_made_drains_the_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """``start_restore`` raises after it made the (deferred) H2D: the flush in the way out
    queues it, so its signals are written, and with no forward to consume them the round is
    drained; the request fails (a HiCacheError: that request only) and the engine serves on."""
    prompt, hit, _ = scene(6)
    e = engine()
    log, ends, forwards = signalled(e, monkeypatch)
    prefix_in_l2(e, prompt)
    controller = e.cache.controller
    move = controller._move

    def refuse_start(req: Any, event: Any, where: str) -> Any:
        if event.name == "START_L2":
            raise MisuseError("refused after the H2D was made")
        return move(req, event, where)

    monkeypatch.setattr(controller, "_move", refuse_start)
    rid = e.submit(prompt, 3)
    outs = {o.id: o for o in e.run()}
    assert "refused after" in (outs[rid].error or "")
    assert forwards == [] and ends == [False]
    each_round_written_once(log)
    monkeypatch.setattr(controller, "_move", move)
    drop_l1(e)
    out = e.generate(prompt, max_new_tokens=3)
    assert out.restored_from == "L2" and same_logits(out, hit)
    e.close()
