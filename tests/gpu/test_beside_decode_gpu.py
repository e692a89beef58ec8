"""Restores started beside the step's forward (a decode batch, or another request's prefill),
on CUDA: the engine marks the caller's stream before launching the forward and starts the
step's restores after the launch, behind that mark only (:meth:`ModelRunner.after`).

Two properties, each with a ``without-*`` variant (run with ``HICACHE_PROVE_WAITS=1``) that
removes the mechanism and asserts the property then fails, so each test is shown able to
fail:

- the restore's copy and layered forward do not wait for the forward (``without-after``:
  issued on the caller's stream, they land after it);
- they still wait for everything queued before the forward (``without-mark``: a write of
  noise queued before the step lands on the restored pages after the copy).

Every scene runs once untimed first: graph captures synchronize the device, and a fresh
stream's first allocation would hide a missing wait.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hicache.backends import dma
from hicache.engine import Engine, Output
from hicache.engine.model import ModelRunner
from hicache.spec.model import Tier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PROVE = os.environ.get("HICACHE_PROVE_WAITS") == "1"
LONG_SLEEP = 1_000_000_000  # ~0.5 s of GPU time: the decode batch, held on the device
SHORT_SLEEP = 100_000_000  # ~50 ms: the noise lands late unless the copy waits for it
# off, or layered with its forward waiting on CUDA events or on layer signals (value waits)
LAYERED = ["off", "events", "values"] if dma.AVAILABLE else ["off"]
# the step's forward the restore starts beside: a decode batch, or a cached prefill of 8 tokens
KINDS = ["decode", "prefill"]


def variants(wait: str) -> list[Any]:
    off = pytest.mark.skipif(not PROVE, reason="set HICACHE_PROVE_WAITS=1 to show the mechanism is needed")
    return [pytest.param(None, id="with-wait"), pytest.param(wait, id=f"without-{wait}", marks=off)]


def drop(monkeypatch: pytest.MonkeyPatch, wait: str | None) -> None:
    """``after``: restores start on the caller's stream (behind the batch). ``mark``: they
    start on the runner's issue stream without waiting for the mark (behind nothing)."""
    if wait == "after":

        @contextlib.contextmanager
        def caller(self: ModelRunner, mark: Any) -> Iterator[None]:
            yield

        monkeypatch.setattr(ModelRunner, "after", caller)
    elif wait == "mark":

        @contextlib.contextmanager
        def unordered(self: ModelRunner, mark: Any) -> Iterator[None]:
            with torch.cuda.stream(self._issue):
                yield

        monkeypatch.setattr(ModelRunner, "after", unordered)


class Scene:
    """An engine whose prefix (18 pages) is in L2 only, with one request decoding (kind
    ``decode``) or another prefix in L1 that a request with a fresh tail extends (``prefill``)."""

    def __init__(self, mode: str, monkeypatch: pytest.MonkeyPatch, kind: str = "decode") -> None:
        monkeypatch.setattr("hicache.engine.model.LAYER_SIGNALS", mode == "values")
        layered = mode != "off"
        rng = self.rng = random.Random(3)
        self.kind = kind
        self.prefix = [rng.randrange(512) for _ in range(288)]
        self.prompt = [*self.prefix, 1, 2, 3]
        self.decoder = [rng.randrange(512) for _ in range(40)]
        self.other = [rng.randrange(512) for _ in range(64)]  # the prefill's cached prefix
        self.e = Engine("tiny", device="cuda", page_size=16, num_pages=256, enable_hicache=True, l2_pages=256,
                        policy="always", max_batch=4, layered_restore=layered)  # fmt: skip
        self.e.generate(self.prefix)
        self.hit = self.e.generate(self.prompt, max_new_tokens=1)
        assert self.hit.restored_from == "L1"

    def start_decoding(self) -> int | None:
        """Drop L1, then step until a fresh request decodes (its pages are its own); kind
        ``prefill``: drop L1, then put the other prefix back in L1 (None)."""
        e = self.e
        e.cache.drain()
        e.cache.core.evict(Tier.L1, 10**6)
        if self.kind == "prefill":
            e.generate(self.other)
            e.cache.drain()
            return None
        rid = e.submit(self.decoder, 40)
        batches = e.stats.decode_batches
        for _ in range(100):
            if e.stats.decode_batches > batches:
                return rid
            e.step()
        raise AssertionError("the decoder never decoded")

    def restore_beside(self, before_step: Any = None) -> Output:
        """Submit the restored prompt (after a request extending the other prefix by 8 fresh
        tokens, kind ``prefill``); its restore starts in a step whose forward is of the
        scene's kind (asserted)."""
        e = self.e
        stat = f"restore_issue_s_beside_{self.kind}"
        started, beside = e.stats.restores_started, getattr(e.stats, stat)
        if self.kind == "prefill":
            e.submit([*self.other, *(self.rng.randrange(512) for _ in range(8))], 1)
        rid = e.submit(self.prompt, 1)
        if before_step is not None:
            before_step()
        forwards = e.stats.decode_batches, e.stats.prefills
        outs = {o.id: o for o in e.step()}
        ran = (e.stats.decode_batches - forwards[0], e.stats.prefills - forwards[1])
        assert e.stats.restores_started == started + 1 and ran == ((1, 0) if self.kind == "decode" else (0, 1))
        assert getattr(e.stats, stat) > beside
        outs.update({o.id: o for o in e.run()})
        return outs[rid]

    def close(self) -> None:
        self.e.cache.check_integrity()
        self.e.close()


def timing_event(stream: Any) -> Any:
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", LAYERED)
@pytest.mark.parametrize("wait", variants("after"))
def test_a_restore_started_beside_a_forward_runs_beside_it(
    kind: str, mode: str, wait: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's forward (a decode batch or a prefill) is held ~0.5 s on the device; the
    restore's copy (and its layered forward) must end before the forward does."""
    s = Scene(mode, monkeypatch, kind)
    s.start_decoding()
    assert s.restore_beside().restored_from == "L2"  # untimed: every stream and graph warm
    drop(monkeypatch, wait)
    s.start_decoding()
    e = s.e
    marks: dict[str, Any] = {}
    forward, h2d, launch, flush = e.runner.forward, e.cache.device.h2d, e._launch_forward, e.cache.device.flush

    def held(seqs: Any, *, layered: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
        if not layered and "batch" not in marks:
            caller = torch.cuda.current_stream()
            marks["start"] = timing_event(caller)
            torch.cuda._sleep(LONG_SLEEP)  # type: ignore[no-untyped-call]
            marks["batch"] = timing_event(caller)
        return forward(seqs, layered=layered, into=into)

    def copy(src: list[int], dst: list[int], layer_events: object = None) -> object:
        ticket = h2d(src, dst, layer_events=layer_events)  # type: ignore[arg-type]
        if not e.cache.device._pending:  # queued now, not deferred (TransferEngine.deferring)
            marks["copy"] = timing_event(e.cache.device.stream)
        return ticket

    def flushed(*args: Any, **kwargs: Any) -> None:
        deferred = bool(e.cache.device._pending)
        flush(*args, **kwargs)
        if deferred:
            marks["copy"] = timing_event(e.cache.device.stream)

    def launched(*args: Any, **kwargs: Any) -> bool:
        out: bool = launch(*args, **kwargs)
        marks["layered"] = timing_event(e.runner._side)
        return out

    monkeypatch.setattr(e.runner, "forward", held)
    monkeypatch.setattr(e.cache.device, "h2d", copy)
    monkeypatch.setattr(e, "_launch_forward", launched)
    monkeypatch.setattr(e.cache.device, "flush", flushed)
    out = s.restore_beside()
    torch.cuda.synchronize()
    assert out.restored_from == "L2"
    assert out.first_logits is not None and s.hit.first_logits is not None
    assert torch.equal(out.first_logits, s.hit.first_logits)
    ends = [k for k in ("copy", "layered") if k in marks]
    assert ends == (["copy", "layered"] if mode != "off" else ["copy"])
    batch = marks["start"].elapsed_time(marks["batch"])
    for k in ends:
        beside = marks["start"].elapsed_time(marks[k]) < batch
        assert beside == (wait is None), f"{k} ended {'before' if beside else 'after'} the decode batch"
    s.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", LAYERED)
@pytest.mark.parametrize("wait", variants("mark"))
def test_a_restore_started_beside_a_forward_waits_for_what_came_before_it(
    kind: str, mode: str, wait: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Noise is written, ~50 ms late, on the caller's stream into every L1 page the decoder
    does not hold (kind ``prefill``: every L1 page), before the step that starts the
    restore: the restore's copy must land after it, so the restored request and a later hit
    on its pages match the first hit."""
    s = Scene(mode, monkeypatch, kind)
    s.start_decoding()
    assert s.restore_beside().restored_from == "L2"  # untimed: every stream and graph warm
    drop(monkeypatch, wait)
    rid = s.start_decoding()
    e = s.e
    mine = set(next(q for q in e._active.values() if q.id == rid).pages) if rid is not None else set()
    others = torch.tensor([p for p in range(e.cache.l1.num_pages) if p not in mine], device="cuda")
    buffer = e.cache.l1.buffer

    def noise() -> None:
        torch.cuda._sleep(SHORT_SLEEP)  # type: ignore[no-untyped-call]
        buffer[:, :, others] = torch.randn(buffer[:, :, others].shape, device="cuda").to(buffer.dtype)

    out = s.restore_beside(before_step=noise)
    again = e.generate(s.prompt, max_new_tokens=1)
    assert out.restored_from == "L2" and again.restored_from == "L1"
    assert out.first_logits is not None and again.first_logits is not None and s.hit.first_logits is not None
    exact = torch.equal(out.first_logits, s.hit.first_logits) and torch.equal(again.first_logits, s.hit.first_logits)
    assert exact == (wait is None), "restored pages were overwritten" if not exact else "no overwrite without the mark"
    s.close()
