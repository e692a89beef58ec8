"""The reference engine on CPU with the tiny model (float32)."""

from __future__ import annotations

import argparse
import itertools
import os
import random
import re
import time
import types
from typing import Any

import numpy as np
import pytest
import torch

from hicache.backends.pools import DevicePool
from hicache.backends.transfer import TransferEngine
from hicache.core.tokens import as_tokens
from hicache.engine import Engine, ModelRunner, build_model, kv_geometry
from hicache.engine.attention import HAVE_TRITON
from hicache.engine.cli import add_engine_args
from hicache.engine.engine import Output, SeqState
from hicache.engine.model import (
    AttentionImpl,
    PagedBatch,
    _folded,
    _graph_inputs,
    fold_mask,
    resolve_attention,
    visible,
)
from hicache.errors import ConfigError, MisuseError
from hicache.spec.model import Direction, Tier

pytest.importorskip("transformers")


INTERPRETED = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
ATTENTIONS = ["gqa", "fold"] + (["paged"] if INTERPRETED else [])  # CPU pools: Triton only interpreted


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_paged_attention_matches_stock_transformers(preset: str, attention: AttentionImpl) -> None:
    """Full prefill, prefill over a cached prefix, and a decode step read from pages give
    the logits of the stock SDPA model, with each way of attending over the context."""
    net = build_model(preset)
    ref = build_model(preset)
    ref.config._attn_implementation = "sdpa"  # type: ignore[union-attr]
    pool = DevicePool.allocate(kv_geometry(net, 4), 32, "cpu")
    pool.buffer.normal_()  # garbage everywhere the request has not written
    run = ModelRunner(net, pool, attention=attention)
    toks = list(range(3, 40))
    pages = [5, 9, 2, 7, 11, 13, 1, 3, 4, 6]
    with torch.inference_mode():
        want = ref(input_ids=torch.tensor([toks])).logits[0, -1]
    torch.testing.assert_close(run.forward([(toks, pages, 0)])[0], want, rtol=1e-5, atol=1e-5)
    run.forward([(toks[:24], pages, 0)])
    torch.testing.assert_close(run.forward([(toks[24:], pages, 24)])[0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run.forward([(toks[36:], pages, 36)])[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_short_fresh_prefill_can_run_as_a_tail_over_its_own_tokens(
    attention: AttentionImpl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``graph_short_prefills``: a prefill with no cached context of at most ``graph_tokens``
    tokens reads its own K/V back from the pool (the path CUDA graphs replay) and gives the
    logits and pages of the direct path; longer ones keep the direct path."""
    import hicache.engine.model as model_module

    net = build_model("tiny")
    read: list[bool] = []
    direct = model_module._logits

    def logits(net: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        read.append(batch.read_slots is not None)  # the path taken: reads its K/V from the pool
        return direct(net, ids, pos, batch)

    monkeypatch.setattr(model_module, "_logits", logits)
    pages = list(range(1, 33))
    for n in (20, 64, 65):
        toks = [(7 * j + 3) % 500 for j in range(n)]
        outs = []
        for flag in (False, True):
            pool = DevicePool.allocate(kv_geometry(net, 4), 40, "cpu")
            torch.manual_seed(0)
            pool.buffer.normal_()  # garbage everywhere the request has not written (the same in both)
            run = ModelRunner(net, pool, attention=attention, graph_short_prefills=flag)
            read.clear()
            out = run.forward([(toks, pages, 0)])[0]
            assert read == [flag and n <= run.graph_tokens], (n, flag)
            used = pages[: -(-n // 4)]
            outs.append((out, pool.buffer[:, :, used].clone()))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
    pool = DevicePool.allocate(kv_geometry(net, 4), 40, "cpu")
    assert not ModelRunner(net, pool, attention=attention).graph_short_prefills  # default: on only with graphs
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    flags: tuple[list[str], ...] = ([], ["--cuda-graph-short-prefills"], ["--cuda-graph-short-prefills", "off"])
    assert [ap.parse_args(f).cuda_graph_short_prefills for f in flags] == ["auto", "on", "off"]


def test_short_fresh_prefills_take_at_most_a_quarter_of_the_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap on graphs for fresh short prefills (host logic, here with graphs faked on
    CPU): the first two lengths of ``max_graphs=8`` take the tail path (which asks for a
    graph), later lengths the direct one (no context, no graph)."""
    net = build_model("tiny")
    pool = DevicePool.allocate(kv_geometry(net, 4), 40, "cpu")
    run = ModelRunner(net, pool, max_graphs=8, graph_short_prefills=True)
    run.graphs_enabled = True  # faked: ``_graph`` only records what it is asked for
    asked: list[tuple[int, int, int, bool]] = []
    monkeypatch.setattr(run, "_graph", lambda *key: asked.append(key))
    for n in (10, 20, 30, 40):
        run.forward([(list(range(n)), list(range(10)), 0)])
    assert [q for (_, q, _, _) in asked] == [10, 20]


def engine(**kw: object) -> Engine:
    args: dict[str, object] = dict(
        device="cpu",
        page_size=4,
        num_pages=64,
        enable_hicache=True,
        l2_pages=64,
        l3_pages=128,
        policy="always",
        transfer_backend="torch",
    )
    args.update(kw)
    return Engine("tiny", **args)  # type: ignore[arg-type]


def test_restored_requests_give_the_l1_hit_logits_exactly() -> None:
    """A request served after a restore from L2 and from L3 produces exactly the logits
    and tokens of the same request served from an L1 hit (the prefix bytes are identical);
    against a full recompute in float32 they agree to a tight tolerance."""
    e = engine()
    prompt = random.Random(1).choices(range(512), k=50)
    first = e.generate(prompt, max_new_tokens=4)
    e.cache.drain()
    l1 = e.generate(prompt, max_new_tokens=4)
    assert l1.cached_tokens == 48 and l1.restored_from == "L1"
    e.cache.core.evict(Tier.L1, 10**6)
    l2 = e.generate(prompt, max_new_tokens=4)
    e.cache.core.evict(Tier.L1, 10**6)
    e.cache.core.evict(Tier.L2, 10**6)
    l3 = e.generate(prompt, max_new_tokens=4)
    assert (l2.restored_from, l3.restored_from) == ("L2", "L3")
    for out in (l2, l3):
        assert out.cached_tokens == 48
        assert out.first_logits is not None and l1.first_logits is not None
        assert torch.equal(out.first_logits, l1.first_logits) and out.tokens == l1.tokens
    assert first.first_logits is not None
    torch.testing.assert_close(first.first_logits, l1.first_logits, rtol=1e-5, atol=1e-5)
    assert first.tokens == l1.tokens
    e.cache.check_integrity()
    e.close()
    with pytest.raises(MisuseError, match="closed"):  # the runner's streams may serve another engine now
        e.runner.forward([([1], [0], 0)])
    e.close()  # twice is harmless


def test_layered_restore_serves_l1_hit_logits_and_a_torn_restore_recomputes() -> None:
    """A layered restore launches the prefill beside the copy and serves its logits once
    the restore is published: exactly the L1 hit's. A restore that fails after leaving
    garbage in its pages discards those logits: the request recomputes, equal to a cold
    run. Nothing leaks either way."""
    e = engine(layered_restore=True)
    prompt = random.Random(4).choices(range(512), k=50)
    cold = e.generate(prompt, max_new_tokens=4)
    e.cache.drain()
    l1 = e.generate(prompt, max_new_tokens=4)
    e.cache.core.evict(Tier.L1, 10**6)
    l2 = e.generate(prompt, max_new_tokens=4)
    assert (l2.restored_from, l2.cached_tokens) == ("L2", 48)
    assert e.stats.layered_prefills == 1 and e.stats.layered_used == 1
    assert l2.first_logits is not None and l1.first_logits is not None
    assert torch.equal(l2.first_logits, l1.first_logits) and l2.tokens == l1.tokens

    h2d = e.cache.device.h2d

    def torn(src: list[int], dst: list[int], layer_events: object = None) -> object:
        ticket = h2d(src, dst, layer_events=layer_events)  # type: ignore[arg-type]
        e.cache.l1.slabs[:, dst] = torch.randn(e.cache.l1.slabs[:, dst].shape)  # garbage landed
        return ticket

    e.cache.device.h2d = torn  # type: ignore[method-assign, assignment]
    e.cache.core.evict(Tier.L1, 10**6)
    e.cache.faults.add("fail", op="read")
    again = e.generate(prompt, max_new_tokens=4)
    assert again.restore_failed and e.stats.layered_prefills == 2 and e.stats.layered_used == 1
    assert again.first_logits is not None and cold.first_logits is not None
    torch.testing.assert_close(again.first_logits, cold.first_logits, rtol=1e-5, atol=1e-5)
    assert again.tokens == cold.tokens
    e.cache.drain()  # backups still in flight hold leases until they finish
    st = e.cache.status()
    assert st.requests == 0 and st.core.leases == 0 and st.core.tiers[0].private == 0
    e.cache.check_integrity()
    e.close()


def test_abort_during_a_layered_restore_leaks_nothing() -> None:
    e = engine(layered_restore=True)
    prompt = random.Random(6).choices(range(512), k=40)
    e.generate(prompt)
    e.cache.drain()
    e.cache.core.evict(Tier.L1, 10**6)
    rid = e.submit([*prompt, 5], max_new_tokens=3)
    e.step()  # admitted: restore started, its prefill launched, not yet published
    assert e.status()["active"] == {"waiting": 0, "restoring": 1, "ready": 0, "decoding": 0}
    assert e.stats.layered_prefills == 1
    assert e.abort(rid)
    e.cache.drain()
    st = e.cache.status()
    assert st.requests == 0 and st.core.leases == 0 and st.pending_restores == 0
    assert st.core.tiers[0].private == 0 and st.core.tiers[0].in_flight == 0
    assert e.cache.core.match(prompt).lengths[0] == 40  # the restore landed, with the tree
    e.cache.check_integrity()
    with pytest.raises(ConfigError, match="prefetch"):
        engine(layered_restore=True, prefetch=False)
    e.close()


def test_a_padded_decode_batch_gives_each_sequence_its_own_logits() -> None:
    """One decode batch over contexts of different lengths (padded, masked) gives each
    sequence the logits of its own one-sequence forward."""
    net = build_model("tiny")
    pool = DevicePool.allocate(kv_geometry(net, 4), 64, "cpu")
    pool.buffer.normal_()
    run = ModelRunner(net, pool)
    rng = random.Random(3)
    seqs = []
    for n, first in ((9, 0), (22, 10), (3, 30)):
        toks = [rng.randrange(512) for _ in range(n)]
        pages = list(range(first, first + n // 4 + 2))
        run.forward([(toks, pages, 0)])
        seqs.append(([rng.randrange(512)], pages, n))
    alone = [run.forward([s])[0] for s in seqs]
    together = run.forward(seqs)
    for b, want in enumerate(alone):
        torch.testing.assert_close(together[b], want, rtol=1e-5, atol=1e-5)


def test_prefill_batches_and_page_tables_are_checked() -> None:
    net = build_model("tiny")
    run = ModelRunner(net, DevicePool.allocate(kv_geometry(net, 4), 8, "cpu"))
    with pytest.raises(ConfigError, match="same, non-zero number"):
        run.forward([([1, 2], [0], 0), ([3], [1], 0)])
    with pytest.raises(ConfigError, match="need 2 pages"):
        run.forward([([1] * 6, [0], 0)])


def test_decode_overlaps_a_pending_restore_and_abort_mid_restore_leaks_nothing() -> None:
    """While one request's L3 restore is in flight (a slow disk), the engine keeps decoding
    another; aborting a request mid-restore returns every page and pin."""
    e = engine()
    rng = random.Random(2)
    a = [rng.randrange(512) for _ in range(40)]
    b = [rng.randrange(512) for _ in range(40)]
    e.generate(a)
    e.cache.drain()
    e.cache.core.evict(Tier.L1, 10**6)
    e.cache.core.evict(Tier.L2, 10**6)
    e.cache.faults.add("slow", op="read", delay_s=0.3)
    long = e.submit(b, max_new_tokens=40)
    while e.stats.decode_batches == 0:
        e.step()
    restoring = e.submit([*a, 1, 2, 3], max_new_tokens=2)
    outs = e.run()
    got = {o.id: o for o in outs}
    assert got[restoring].restored_from == "L3" and got[restoring].cached_tokens == 40
    assert len(got[long].tokens) == 40
    assert e.stats.decode_s_while_restoring > 0
    assert e.cache.metrics.restore_overlapped_s > 0
    # The pending restore's time is split: it started (host issue), then the engine decoded or,
    # with nothing to decode, waited.
    es = e.stats
    assert es.restore_issue_s > 0 and es.layered_launch_s == 0
    assert es.decode_s_while_restoring <= es.decode_s
    # Abort mid-restore: nothing leaks, the restore completes into the tree.
    e.cache.core.evict(Tier.L1, 10**6)
    e.cache.core.evict(Tier.L2, 10**6)
    e.cache.faults.add("slow", op="read", delay_s=0.2)
    rid = e.submit([*a, 9], max_new_tokens=3)  # a tail token: the whole of `a` is restored
    e.step()
    assert e.status()["active"] == {"waiting": 0, "restoring": 1, "ready": 0, "decoding": 0}
    assert e.abort(rid) and not e.abort(rid)
    aborted = next(o for o in e.run() if o.id == rid)  # no restore served it
    assert aborted.error == "aborted" and aborted.restored_from == "L1" and aborted.cached_tokens == 0
    e.cache.drain()
    st = e.cache.status()
    assert st.requests == 0 and st.core.leases == 0 and st.pending_restores == 0
    assert st.core.tiers[0].private == 0 and st.core.tiers[0].in_flight == 0
    # the abandoned S2H landed in L2, with the tree, or was withdrawn before it started
    assert e.cache.core.match(a).lengths[1:] in ((40, 40), (0, 40))
    e.cache.check_integrity()
    e.close()


def test_the_layered_restore_is_on_by_default_where_the_copy_can_signal_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``layered_restore=None`` (the default, CLI ``auto``) follows the transfer engine's
    ``layered`` (CUDA with cuda-python); without prefetch or hicache it stays off."""
    e = engine()
    assert e.layered is False  # CPU: the copy cannot signal layers
    e.close()
    monkeypatch.setattr(TransferEngine, "layered", property(lambda self: True))
    off: dict[str, object] = {"enable_hicache": False, "l2_pages": 0, "l3_pages": 0}
    for kw, want in (({}, True), ({"prefetch": False}, False), (off, False)):
        e = engine(**kw)
        assert e.layered is want, kw
        e.close()
    e = engine(layered_restore=False)
    assert e.layered is False
    e.close()
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    assert ap.parse_args([]).hicache_layered_restore == "auto"


def test_blocking_mode_serves_the_same_tokens() -> None:
    """``prefetch=False`` (the seed's blocking restore) gives the same outputs."""
    outs = []
    for prefetch in (True, False):
        e = engine(prefetch=prefetch)
        rng = random.Random(5)
        p = [rng.randrange(512) for _ in range(30)]
        e.generate(p)
        e.cache.drain()
        e.cache.core.evict(Tier.L1, 10**6)
        o = e.generate([*p, 7], max_new_tokens=3)
        assert o.restored_from == "L2"
        outs.append(o.tokens)
        e.close()
    assert outs[0] == outs[1]


def test_a_forward_that_captured_a_graph_does_not_teach_the_cost_model() -> None:
    """Graph capture is one-time setup: such a prefill's time is no recompute sample (counted
    as calls, not as kept samples: the model may hold back a slow sample on a loaded box)."""
    e = engine()
    rng = random.Random(9)
    seen: list[int] = []
    observe = e.cache.cost.observe_prefill

    def spy(tokens: int, seconds: float) -> None:
        seen.append(tokens)
        observe(tokens, seconds)

    e.cache.cost.observe_prefill = spy  # type: ignore[method-assign]
    e.generate([rng.randrange(512) for _ in range(20)])
    assert seen == [20]
    forward = e.runner.forward

    def capturing(seqs: list[tuple[list[int], list[int], int]]) -> torch.Tensor:
        out = forward(seqs)
        e.runner.captured_last = True  # as a CUDA forward that captured its graph reports
        return out

    e.runner.forward = capturing  # type: ignore[method-assign, assignment]
    e.generate([rng.randrange(512) for _ in range(20)])
    assert seen == [20]
    e.runner.forward = forward  # type: ignore[method-assign]
    e.generate([rng.randrange(512) for _ in range(20)])
    assert seen == [20, 20]
    e.close()


def test_mixed_workload_keeps_integrity() -> None:
    """200 requests over shared and rotating prefixes, served in continuous batches with
    random aborts, under L1 and L2 pressure."""
    rng = random.Random(0)
    e = engine(num_pages=64, l2_pages=40, l3_pages=96, policy="cost", max_batch=4)
    prefixes = [[rng.randrange(512) for _ in range(rng.randrange(8, 60))] for _ in range(6)]
    served = aborted = 0
    for i in range(200):
        prompt = rng.choice(prefixes) + [rng.randrange(512) for _ in range(rng.randrange(0, 10))]
        rid = e.submit(prompt, max_new_tokens=rng.randrange(1, 4))
        if rng.random() < 0.1:
            for _ in range(rng.randrange(3)):
                served += sum(o.error is None for o in e.step())
            aborted += e.abort(rid)
        if i % 4 == 3:
            outs = e.run()
            assert {o.error for o in outs} <= {None, "aborted"}
            served += sum(o.error is None for o in outs)
        if i % 20 == 0:
            e.cache.check_integrity()
    served += sum(o.error is None for o in e.run())
    assert e.stats.errors == 0, e.stats
    assert served + aborted == 200 and e.stats.finished == served
    e.cache.drain()
    st = e.cache.status()
    assert st.requests == 0 and st.core.leases == 0
    assert st.metrics["hit_tokens"]["L1"] > 0
    assert e.stats.decode_batches > 0 and e.stats.decode_tokens > e.stats.decode_batches  # batched
    e.cache.check_integrity()
    e.close()


def test_bad_requests_are_refused_before_anything_changes() -> None:
    e = engine()
    for prompt, kind in (([], MisuseError), ([1, 512], ConfigError), ([1, -1], ConfigError), ([1.5], MisuseError)):
        with pytest.raises(kind):
            e.submit(prompt)  # type: ignore[arg-type]
    for count in (0, -1, 1.5, True, np.bool_(True), None, "2", np.float64(2.0)):
        with pytest.raises(ConfigError, match="max_new_tokens"):
            e.submit([1, 2], count)  # type: ignore[arg-type]
    assert e.pending == 0 and e.stats.submitted == 0
    e.close()


def test_a_numpy_count_of_new_tokens_is_its_int() -> None:
    """A count from numpy (a tokenizer's or a sampler's array) is taken as the int it holds,
    as numpy token ids are."""
    e = engine()
    plain = e.generate([1, 2, 3], max_new_tokens=3).tokens
    assert e.generate([1, 2, 3], max_new_tokens=np.int64(3)).tokens == plain  # type: ignore[arg-type]
    assert len(plain) == 3
    e.close()


def test_folded_attention_equals_grouped_query_attention() -> None:
    """Folding the query groups is the same computation as SDPA's enable_gqa, masks with
    padding and per-sequence context lengths included."""
    g = torch.Generator().manual_seed(0)
    b, hq, h, q, t, d = 3, 8, 2, 5, 37, 16
    query = torch.randn(b, hq, q, d, generator=g)
    k, v = torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)
    ctx = torch.tensor([37, 20, 9])
    mask = visible(ctx, q, t)
    want = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(_folded(query, k, v, fold_mask(mask, hq // h), None), want, rtol=1e-5, atol=1e-5)
    want = torch.nn.functional.scaled_dot_product_attention(query[:, :, :1], k, v, enable_gqa=True, scale=0.3)
    torch.testing.assert_close(_folded(query[:, :, :1], k, v, None, 0.3), want, rtol=1e-5, atol=1e-5)


def test_model_runner_rejects_unknown_attention_options() -> None:
    net = build_model("tiny")
    pool = DevicePool.allocate(kv_geometry(net, 4), 8, "cpu")
    with pytest.raises(ConfigError, match="'flash'"):
        ModelRunner(net, pool, attention="flash")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'sometimes'"):
        ModelRunner(net, pool, cudnn="sometimes")  # type: ignore[arg-type]


def test_layer_groups_must_cover_every_layer_in_order() -> None:
    net = build_model("tiny")  # 2 layers
    pool = DevicePool.allocate(kv_geometry(net, 4), 8, "cpu")
    ModelRunner(net, pool, layer_groups=[(0, 2)])
    for bad in ([(0, 1)], [(1, 2), (0, 1)], [(0, 1), (0, 2)]):
        with pytest.raises(ConfigError, match="do not cover"):
            ModelRunner(net, pool, layer_groups=bad)


def test_a_paged_batch_needs_context_lengths() -> None:
    net = build_model("tiny")
    pool = DevicePool.allocate(kv_geometry(net, 4), 8, "cpu")
    write, read = torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ConfigError, match="context lengths"):
        PagedBatch(pool, write, read, None, "paged")
    with pytest.raises(ConfigError, match="'auto'"):
        PagedBatch(pool, write, read, None, "auto")
    assert PagedBatch(pool, write, None, None, "paged").ctx is None  # a fresh prefill reads no context


def test_auto_attention_is_the_paged_kernel_on_cuda_only() -> None:
    assert resolve_attention("auto", "cpu") == "gqa"
    assert resolve_attention("auto", "cuda") == ("paged" if HAVE_TRITON else "gqa")
    assert resolve_attention("fold", "cuda") == "fold"
    net = build_model("tiny")
    assert ModelRunner(net, DevicePool.allocate(kv_geometry(net, 4), 8, "cpu")).attention == "gqa"


def test_idle_steps_back_off_while_every_restore_reads_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """With only an L3 read in flight, each idle step sleeps twice as long as the one before
    (from 100 us up to 1.6 ms), so a slow disk costs the scheduler thread few polls; the
    restore still lands bit-exact, and the next idle wait starts short again."""
    from hicache.engine import engine as engine_module

    e = engine()
    rng = random.Random(5)
    a = [rng.randrange(512) for _ in range(40)]
    e.generate(a)
    e.cache.drain()
    e.cache.core.evict(Tier.L1, 10**6)
    e.cache.core.evict(Tier.L2, 10**6)
    slept: list[float] = []
    real = engine_module.Engine._idle_sleep_s

    def spy(self: Engine) -> float:
        slept.append(real(self))
        return slept[-1]

    monkeypatch.setattr(engine_module.Engine, "_idle_sleep_s", spy)
    e.cache.faults.add("slow", op="read", delay_s=0.05)
    (out,) = [e.generate([*a, 7, 8, 9], max_new_tokens=2)]
    assert out.restored_from == "L3" and out.cached_tokens == 40
    step = engine_module.IDLE_SLEEP_S
    reading = list(itertools.takewhile(lambda t: t > step, slept))
    assert reading, "the read was slow: the engine must have waited"
    assert reading == [step * 2 ** min(k, engine_module.IDLE_BACKOFF_STEPS) for k in range(1, len(reading) + 1)]
    assert reading[-1] == step * 2**engine_module.IDLE_BACKOFF_STEPS  # 50 ms of reading outlasts the ramp
    # then the H2D: polled at the short interval until it is published
    assert slept[len(reading) :] == [step] * (len(slept) - len(reading))
    assert e._idle_streak == 0  # reset once the engine had work again
    e.cache.check_integrity()
    e.close()


def test_idle_steps_stay_short_while_a_copy_engine_transfer_is_in_flight() -> None:
    """A restore whose H2D is in flight (microseconds to milliseconds), where the cache cannot
    wait for it (HiCache.settle), is polled every 50 us: no back-off."""
    from hicache.engine import engine as engine_module

    e = engine()
    seq = engine_module._Seq(
        id=1, prompt=as_tokens([1, 2, 3]), max_new=1, arrived=0.0, state=engine_module.SeqState.RESTORING
    )
    transfer = type("T", (), {"direction": Direction.H2D})()
    seq.restore = type("R", (), {"transfer": transfer})()
    e._active[1] = seq
    e._idle_streak = 3
    assert [e._idle_sleep_s() for _ in range(3)] == [engine_module.IDLE_SLEEP_S] * 3
    transfer.direction = Direction.S2H
    assert [e._idle_sleep_s() for _ in range(2)] == [2 * engine_module.IDLE_SLEEP_S, 4 * engine_module.IDLE_SLEEP_S]
    del e._active[1]
    e.close()


@pytest.mark.parametrize("waited", [True, False])
def test_an_idle_step_waits_for_the_first_restore_copy_instead_of_sleeping(
    monkeypatch: pytest.MonkeyPatch, waited: bool
) -> None:
    """With only a non-layered restore in flight, an idle step asks the cache to wait for the
    first restore copy (HiCache.settle); only if nothing was waited for does it sleep, and a
    wait starts the back-off over."""
    from hicache.engine import engine as engine_module

    e = engine()
    seq = engine_module._Seq(
        id=1, prompt=as_tokens([1, 2, 3]), max_new=1, arrived=0.0, state=engine_module.SeqState.RESTORING
    )
    seq.restore = type("R", (), {"transfer": type("T", (), {"direction": Direction.S2H})(), "finished": False})()
    e._active[1] = seq
    e._idle_streak = 3
    settles: list[bool] = []
    sleeps: list[float] = []

    def settle() -> bool:
        settles.append(waited)
        return waited

    monkeypatch.setattr(e.cache, "settle", settle)
    monkeypatch.setattr("hicache.engine.engine.time.sleep", sleeps.append)
    e.step()
    assert settles == [waited]
    assert (sleeps == []) is waited
    assert e._idle_streak == (0 if waited else 4)
    assert e.stats.idle_polls == 1
    del e._active[1]
    monkeypatch.undo()
    e.close()


def _order_of(e: Engine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the engine's forwards (``prefill`` / ``decode``) and restore starts in order."""
    seen: list[str] = []
    forward, start = e.runner.forward, e.cache.start_restore

    def fwd(seqs: Any, **kw: Any) -> torch.Tensor:
        seen.append("decode" if all(len(s[0]) == 1 and s[2] > 0 for s in seqs) else "prefill")
        return forward(seqs, **kw)

    def started(*args: Any, **kw: Any) -> Any:
        seen.append("start")
        return start(*args, **kw)

    monkeypatch.setattr(e.runner, "forward", fwd)
    monkeypatch.setattr(e.cache, "start_restore", started)
    return seen


def _in_l2_only(seed: int) -> tuple[Engine, list[int], Output]:
    """An engine that served a 50-token prompt once (its output returned) and holds its
    prefix in L2 only."""
    e = engine(max_batch=4)
    prompt = random.Random(seed).choices(range(512), k=50)
    first = e.generate(prompt, max_new_tokens=3)
    e.cache.drain()
    e.cache.core.evict(Tier.L1, 10**6)
    return e, prompt, first


def _start_decoding(e: Engine, rng: random.Random) -> None:
    """Step until one long request is decoding (the next steps run decode batches)."""
    decoder = e.submit([rng.randrange(512) for _ in range(9)], max_new_tokens=40)
    for _ in range(100):
        if e.state_of(decoder) is SeqState.DECODING:
            return
        e.step()
    raise AssertionError("the decoder never started decoding")


def test_a_restore_admitted_beside_decode_starts_after_the_batch_is_launched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With requests decoding, a restore admitted in a step starts after that step's decode
    batch is launched and before its tokens are read (its host work runs beside the batch
    on a GPU); the restored request still gets the L1 hit's tokens."""
    e, prompt, l1 = _in_l2_only(7)
    _start_decoding(e, random.Random(7))
    seen = _order_of(e, monkeypatch)
    rid = e.submit(prompt, max_new_tokens=3)
    e.step()  # admits it: its restore starts beside this step's decode batch
    assert seen == ["decode", "start"], seen
    assert e.state_of(rid) is SeqState.RESTORING
    outs = e.run()
    mine = next(o for o in outs if o.id == rid)
    assert (mine.restored_from, mine.tokens) == ("L2", l1.tokens)
    assert e.stats.restore_issue_s_beside_decode > 0
    e.cache.check_integrity()


def test_a_restore_admitted_beside_a_prefill_starts_after_its_forward_is_launched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh prompt and a restore admitted in one step, nothing decoding: the step's
    prefill is launched first and the restore starts after it, before its logits are read
    (the restore's host work runs beside the prefill on a GPU). Both requests get the
    tokens they get alone."""
    e, prompt, l1 = _in_l2_only(17)
    fresh = random.Random(18).choices(range(512), k=23)
    cold = engine(enable_hicache=False, l2_pages=0, l3_pages=0).generate(fresh, max_new_tokens=3)
    seen = _order_of(e, monkeypatch)
    rids = [e.submit(fresh, max_new_tokens=3), e.submit(prompt, max_new_tokens=3)]
    e.step()
    assert seen == ["prefill", "start"], seen
    assert e.state_of(rids[1]) is SeqState.RESTORING
    assert e.stats.restore_issue_s_beside_prefill > 0 and e.stats.restore_issue_s_beside_decode == 0
    outs = {o.id: o for o in e.run()}
    assert (outs[rids[0]].restored_from, outs[rids[0]].tokens) == ("L1", cold.tokens)
    assert (outs[rids[1]].restored_from, outs[rids[1]].tokens) == ("L2", l1.tokens)
    e.cache.check_integrity()


def test_a_restore_admitted_beside_a_prefill_with_no_room_starts_in_the_same_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step's prefill finds no L1 room (so launches nothing): the restore admitted with
    it still starts in that step, and both requests are served after."""
    e, prompt, l1 = _in_l2_only(21)
    fresh = random.Random(22).choices(range(512), k=23)
    allocate, calls = e.cache.allocate, []

    def no_room_once(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return None if len(calls) == 1 else allocate(*args, **kw)

    monkeypatch.setattr(e.cache, "allocate", no_room_once)
    seen = _order_of(e, monkeypatch)
    rids = [e.submit(fresh, max_new_tokens=2), e.submit(prompt, max_new_tokens=3)]
    prefills = e.stats.prefills
    e.step()
    assert seen == ["start"] and e.stats.prefills == prefills, seen
    restoring = e._active[rids[1]]
    assert restoring.restore is not None or restoring.state is not SeqState.RESTORING
    outs = {o.id: o for o in e.run()}
    assert outs[rids[0]].error is None and (outs[rids[1]].restored_from, outs[rids[1]].tokens) == ("L2", l1.tokens)
    e.cache.check_integrity()


def _prefill_samples(e: Engine, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The prefill times the engine teaches its cost model from now on (still taught)."""
    samples: list[float] = []
    observe = e.cache.observe_prefill

    def observed(tokens: int, seconds: float) -> None:
        samples.append(seconds)
        observe(tokens, seconds)

    monkeypatch.setattr(e.cache, "observe_prefill", observed)
    return samples


@pytest.mark.parametrize("with_restore", [True, False])
def test_a_prefills_own_time_leaves_out_the_restore_starts_beside_it(
    monkeypatch: pytest.MonkeyPatch, with_restore: bool
) -> None:
    """The engine's clock jumps 1000 s inside each forward and 10**6 s inside each restore
    start: a prefill, with or without a restore started beside it, reports (and teaches the
    cost model) its forward's time, about 1000 s, not the start's and not twice its own."""
    e, prompt, _ = _in_l2_only(19)
    fresh = random.Random(20).choices(range(512), k=23)
    real, offset = time.perf_counter, [0.0]
    monkeypatch.setattr("hicache.engine.engine.time", types.SimpleNamespace(perf_counter=lambda: real() + offset[0]))
    start, forward = e.cache.start_restore, e.runner.forward

    def slow_start(*args: Any, **kw: Any) -> Any:
        offset[0] += 1e6
        return start(*args, **kw)

    def slow_forward(*args: Any, **kw: Any) -> Any:
        offset[0] += 1000.0
        return forward(*args, **kw)

    monkeypatch.setattr(e.cache, "start_restore", slow_start)
    monkeypatch.setattr(e.runner, "forward", slow_forward)
    samples = _prefill_samples(e, monkeypatch)
    rids = [e.submit(fresh, max_new_tokens=1)] + ([e.submit(prompt, max_new_tokens=1)] if with_restore else [])
    prefill_s = e.stats.prefill_s
    done = e.step()
    assert offset[0] == (1e6 if with_restore else 0) + 1000.0
    assert (e.stats.restore_issue_s_beside_prefill >= 1e6) is with_restore
    outs = {o.id: o for o in done}
    own = outs[rids[0]].prefill_s
    assert own is not None and 1000.0 <= own < 1100.0, own
    assert len(samples) == 1 and 1000.0 <= samples[0] < 1100.0, samples
    assert 1000.0 <= e.stats.prefill_s - prefill_s < 1100.0
    # on a CPU the prefill has run when the restore starts: nearly none of it is beside it
    assert e.stats.prefill_s_while_restoring < 1.0


class _Event:
    """A stand-in for the engine's CUDA event after a forward's launch: ``query()`` says
    whether the forward had ended when the restore starts beside it returned."""

    def __init__(self, ended: bool) -> None:
        self.ended = ended

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.ended


@pytest.mark.parametrize("ended", [True, False])
def test_a_prefill_that_ended_during_the_starts_beside_it_teaches_the_cost_model_nothing(
    monkeypatch: pytest.MonkeyPatch, ended: bool
) -> None:
    """On a GPU a prefill that ended while the restores beside it were starting ended at
    an unknown point of them: no sample for the cost model (one that was still running when
    they returned gives one, its logits' wait being its own)."""
    e, prompt, _ = _in_l2_only(23)
    monkeypatch.setattr(e, "_batch_end", _Event(ended))
    samples = _prefill_samples(e, monkeypatch)
    fresh = random.Random(24).choices(range(512), k=23)
    e.submit(fresh, max_new_tokens=1)
    e.submit(prompt, max_new_tokens=1)
    e.step()
    assert e.stats.restore_issue_s_beside_prefill > 0
    assert len(samples) == (0 if ended else 1), samples
    e.run()
    e.cache.check_integrity()


def test_a_prefill_beside_a_refused_restore_is_not_time_while_restoring(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore admitted with a prefill and refused when it starts never ran: none of the
    prefill counts as time while a restore was pending."""
    e, prompt, l1 = _in_l2_only(25)
    monkeypatch.setattr(e.cache, "start_restore", lambda *a, **k: None)
    fresh = random.Random(26).choices(range(512), k=23)
    rids = [e.submit(fresh, max_new_tokens=2), e.submit(prompt, max_new_tokens=3)]
    e.step()
    assert e.stats.prefill_s_while_restoring == 0.0 and e.stats.restores_failed == 1
    outs = {o.id: o for o in e.run()}
    assert outs[rids[1]].restore_failed and outs[rids[1]].tokens == l1.tokens


def test_an_exception_escaping_a_prefill_before_its_launch_leaves_the_restores_to_recompute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Something that is not a request's failure (a bug, an interrupt) escapes the step's
    prefill before its forward is launched, so the restores admitted with it never started:
    they are not left waiting as restoring; they recompute, with the tokens of their first
    run, and the cache stays consistent."""
    e, prompt, l1 = _in_l2_only(27)
    calls = _raise_once(monkeypatch, e, "prefix_pages")
    fresh = random.Random(28).choices(range(512), k=23)
    rids = [e.submit(fresh, max_new_tokens=2), e.submit(prompt, max_new_tokens=3)]
    with pytest.raises(RuntimeError, match="not a request's failure"):
        e.step()
    assert len(calls) == 1 and e.state_of(rids[1]) is SeqState.READY
    outs = {o.id: o for o in e.run()}
    assert outs[rids[1]].error is None and outs[rids[1]].restore_failed and outs[rids[1]].tokens == l1.tokens
    assert outs[rids[0]].error is None
    e.cache.check_integrity()
    e.cache.drain()  # backups still in flight hold leases until they finish
    st = e.cache.status()
    assert st.requests == 0 and st.core.leases == 0


def test_without_decode_a_restore_starts_before_the_steps_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing decoding: the admitted restore starts at once, before any forward of the
    step (no batch to hide it behind, none to delay it)."""
    e = engine()
    prompt = random.Random(8).choices(range(512), k=50)
    e.generate(prompt, max_new_tokens=2)
    e.cache.drain()
    e.cache.core.evict(Tier.L1, 10**6)
    seen = _order_of(e, monkeypatch)
    out = e.generate(prompt, max_new_tokens=2)
    assert out.restored_from == "L2" and seen[0] == "start" and "decode" in seen
    assert e.stats.restore_issue_s_beside_decode == 0


@pytest.mark.parametrize("decoding", [False, True])
def test_a_restore_whose_start_is_refused_recomputes(monkeypatch: pytest.MonkeyPatch, decoding: bool) -> None:
    """``start_restore`` refusing (None) leaves the request ready to recompute, with or
    without a decode batch beside the start: it finishes with the tokens of a cold run."""
    e, prompt, cold = _in_l2_only(9)
    if decoding:
        _start_decoding(e, random.Random(9))
    monkeypatch.setattr(e.cache, "start_restore", lambda *a, **k: None)
    rid = e.submit(prompt, max_new_tokens=3)
    outs: list[Output] = []
    for _ in range(200):  # bounded: a request stuck in RESTORING would never finish
        outs += e.step()
        if any(o.id == rid for o in outs):
            break
    mine = next(o for o in outs if o.id == rid)
    assert mine.restore_failed and mine.error is None and mine.tokens == cold.tokens
    e.run()
    e.cache.drain()  # backups still in flight hold leases until they finish
    st = e.cache.status()
    assert st.requests == 0 and st.core.leases == 0


def _raise_once(monkeypatch: pytest.MonkeyPatch, e: Engine, name: str) -> list[int]:
    """The engine's ``cache.<name>`` raises a RuntimeError (not a request's failure: a bug,
    an interrupt) on its first call, then works; returns the list of calls made."""
    real, calls = getattr(e.cache, name), []

    def flaky(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("not a request's failure")
        return real(*args, **kw)

    monkeypatch.setattr(e.cache, name, flaky)
    return calls


@pytest.mark.parametrize("beside", [None, "decode", "prefill"])
def test_an_exception_escaping_a_restore_start_leaves_the_others_to_recompute(
    monkeypatch: pytest.MonkeyPatch, beside: str | None
) -> None:
    """Two restores admitted in one step (alone, beside a decode batch, or beside another
    request's prefill); the first start raises something that is not a request's failure (a
    bug, an interrupt), which escapes the step. Neither request may be left waiting for a
    restore that never comes: both finish, recomputed, with the tokens of their first runs,
    the prefill's request too, and the cache stays consistent."""
    e = engine(max_batch=4)
    prompts = [random.Random(seed).choices(range(512), k=50) for seed in (1, 2)]
    first = [e.generate(p, max_new_tokens=2) for p in prompts]
    fresh = random.Random(4).choices(range(512), k=13)
    cold = engine(enable_hicache=False, l2_pages=0, l3_pages=0).generate(fresh, max_new_tokens=2)
    e.cache.drain()
    e.cache.core.evict(Tier.L1, 10**6)
    if beside == "decode":
        _start_decoding(e, random.Random(3))
    other = e.submit(fresh, max_new_tokens=2) if beside == "prefill" else None
    calls = _raise_once(monkeypatch, e, "start_restore")
    rids = [e.submit(p, max_new_tokens=2) for p in prompts]
    prefills = e.stats.prefills
    with pytest.raises(RuntimeError, match="not a request's failure"):
        e.step()
    assert len(calls) == 1 and all(e.state_of(r) is SeqState.READY for r in rids)
    assert e.stats.prefills == prefills  # a prefill the start escaped from did not finish
    outs = {o.id: o for o in e.run()}
    for rid, want in zip(rids, first, strict=True):
        assert outs[rid].error is None and outs[rid].restored_from == "L1" and outs[rid].tokens == want.tokens
    if other is not None:
        assert outs[other].error is None and outs[other].tokens == cold.tokens
    e.cache.check_integrity()
    e.cache.drain()  # backups still in flight hold leases until they finish
    st = e.cache.status()
    assert st.requests == 0 and st.core.leases == 0


def test_an_exception_escaping_admission_leaves_the_request_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cache.admit`` raising something that is not the request's failure escapes the step;
    the request was not admitted, so it waits again and is served by the next steps."""
    e = engine()
    prompt = random.Random(5).choices(range(512), k=30)
    want = e.generate(prompt, max_new_tokens=2)
    _raise_once(monkeypatch, e, "admit")
    rid = e.submit(prompt, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="not a request's failure"):
        e.step()
    assert e.state_of(rid) is SeqState.WAITING
    (out,) = e.run()
    assert out.id == rid and out.error is None and out.tokens == want.tokens
    e.cache.check_integrity()


def test_a_decode_batch_credits_a_restore_started_after_it_nothing_on_cpu() -> None:
    """On a CPU the batch has run before the restores admitted beside it start: it counts as
    decode time, not as decode while restoring, and the restore is credited no overlap."""
    e, prompt, _ = _in_l2_only(4)
    _start_decoding(e, random.Random(4))
    before, overlapped = e.stats.decode_s_while_restoring, e.cache.metrics.restore_overlapped_s
    rid = e.submit(prompt, max_new_tokens=1)
    decode_s, batches = e.stats.decode_s, e.stats.decode_batches
    e.step()
    assert e.stats.decode_batches == batches + 1 and e.stats.decode_s > decode_s
    assert e.state_of(rid) is SeqState.RESTORING and e.stats.decode_s_while_restoring == before
    e.run()
    assert e.cache.metrics.restore_overlapped_s == overlapped


def test_run_returns_the_outputs_of_requests_aborted_before_it() -> None:
    """Aborting every request leaves nothing to step; ``run`` still hands back their
    outputs (error "aborted"), once."""
    e = engine()
    rids = [e.submit(list(range(1, 10 + i)), max_new_tokens=2) for i in range(3)]
    e.step()
    assert all(e.abort(r) for r in rids)
    outs = e.run()
    assert sorted(o.id for o in outs) == rids and all(o.error == "aborted" for o in outs)
    assert e.run() == [] and e.step() == []


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_graph_inputs_built_in_place_match_the_slots_of_each_sequence(page_size: int) -> None:
    """A replayed graph's inputs (written straight into the pinned staging buffer) are the
    ids, positions, write slots, read slots padded with the last token's slot, and context
    lengths that the eager path builds from :meth:`ModelRunner.slots`, for contexts that end
    anywhere in a page, with pages in any order and spare pages past the context."""
    net = build_model("tiny")
    run = ModelRunner(net, DevicePool.allocate(kv_geometry(net, page_size), 64, "cpu"))
    rng = random.Random(page_size)
    for q in (1, 3):
        for cached in (0, 1, page_size - 1, page_size, 2 * page_size + 1, 37):
            seqs = []
            for _ in range(3):
                c = cached + q + rng.randrange(3)  # contexts differ within a batch
                pages = rng.sample(range(64), -(-c // page_size) + rng.randrange(2))
                seqs.append(([rng.randrange(1000) for _ in range(q)], pages, c - q))
            ctx = [c + q for _, _, c in seqs]
            t = max(ctx) + 5  # a graph's bucket pads the reads
            b = len(seqs)
            out = np.full(3 * b * q + b * t + b, -1, dtype=np.int64)
            used = [np.array(p[: -(-c // page_size)]) for (_, p, _), c in zip(seqs, ctx, strict=True)]
            _graph_inputs(np.array([s[0] for s in seqs]), used, ctx, t, page_size, out)
            ids = torch.tensor([s[0] for s in seqs])
            pos = torch.stack([torch.arange(c - q, c) for c in ctx])
            write = torch.stack([run.slots(p, c - q, c) for (_, p, _), c in zip(seqs, ctx, strict=True)])
            read = torch.empty(b, t, dtype=torch.int64)
            for i, ((_, p, _), c) in enumerate(zip(seqs, ctx, strict=True)):
                read[i, :c] = run.slots(p, 0, c)
                read[i, c:] = write[i, -1]
            want = torch.cat([ids.reshape(-1), pos.reshape(-1), write.reshape(-1), read.reshape(-1), torch.tensor(ctx)])
            assert out.tolist() == want.tolist(), (q, cached)


def test_too_few_pages_for_a_graph_replay_raise_what_the_eager_path_raises() -> None:
    net = build_model("tiny")
    run = ModelRunner(net, DevicePool.allocate(kv_geometry(net, 4), 16, "cpu"))
    seqs = [([1, 2], [3, 4], 7)]  # 9 tokens need 3 pages of 4
    with pytest.raises(ConfigError) as eager:
        run.slots([3, 4], 7, 9)
    with pytest.raises(ConfigError) as checked:
        run._check_pages(seqs, [9])
    assert str(checked.value) == str(eager.value)


class _NoEvent:
    """A stand-in for the staging buffers' CUDA events (CPU: the upload is done at once)."""

    def synchronize(self) -> None:
        pass

    def record(self) -> None:
        pass


def test_graph_replays_with_staged_inputs_match_eager_forwards_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay path that writes a graph's inputs into the staging buffer (CUDA only) run
    on CPU: a "graph" that runs its body on the inputs in its ``flat`` must give the eager
    forward's logits for decode steps and short extends of batches whose contexts differ,
    honour ``into``, and leave no graph behind for a batch whose tokens are not ints."""
    staged, eager = _staged_runners(monkeypatch, num_pages=96, max_graphs=64)
    runners = [staged, eager]
    net = staged.net
    flat = staged._upload_flat
    uploads: list[int] = []

    def counted(dst: torch.Tensor, fill: Any) -> None:
        uploads.append(dst.numel())
        flat(dst, fill)

    monkeypatch.setattr(staged, "_upload_flat", counted)
    rng = random.Random(0)
    seqs: list[tuple[list[int], list[int]]] = []  # pages, tokens so far
    for i in range(4):  # fresh prefills (not staged): each sequence's first tokens
        n, pages = rng.randrange(3, 12), rng.sample(range(i * 24, i * 24 + 24), 24)
        toks = [rng.randrange(200) for _ in range(n)]
        for r in runners:
            r.forward([(toks, pages, 0)])
        seqs.append((pages, [n]))
    vocab = int(net.config.vocab_size)  # type: ignore[union-attr, arg-type]
    replays = 0
    for step in range(30):
        q = 1 if step % 3 else 2
        batch: list[tuple[list[int], list[int], int]] = []
        for j in rng.sample(range(4), rng.randrange(1, 5)):
            pages, length = seqs[j]
            batch.append(([rng.randrange(200) for _ in range(q)], pages, length[0]))
            length[0] += q
        into = torch.empty(len(batch), vocab) if step % 5 == 4 else None
        before: int = staged.graph_replays
        got, want = staged.forward(batch, into=into), eager.forward(batch)
        replays += staged.graph_replays - before
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if into is not None and staged.graph_replays > before and not staged.captured_last:
            assert got.data_ptr() == into.data_ptr()
    assert replays == 30 and staged.eager_forwards == eager.eager_forwards - 30 and len(uploads) == 30
    made = len(staged._graphs)
    pages, length = seqs[0]
    for wrong in (96, -1):  # a page outside the pool, on the staged path too
        with pytest.raises(ConfigError, match=f"page {wrong} is not in the pool's"):
            staged.forward([([1], [*pages[:-1], wrong], 4 * len(pages) - 1)])
    bad: Any = [None]
    with pytest.raises(ConfigError, match="new tokens must be ints, got None"):
        staged.forward([(bad, pages, length[0] + 40)])  # a new shape: its graph must not be made
    assert len(staged._graphs) == made


@pytest.mark.parametrize(
    ("pages", "cached", "says"),
    [
        ([3, 4, 16], 8, "page 16 is not in the pool's [0, 16)"),
        ([3, -1, 5], 8, "page -1 is not in the pool's [0, 16)"),
        ([3, 4, 5], -4, "a cached length must be an int >= 0, got -4"),
        ([3, 4, 5], 2.0, "a cached length must be an int >= 0, got 2.0"),
        ([3, 4, 5], True, "a cached length must be an int >= 0, got True"),
    ],
)
def test_a_forward_refuses_pages_outside_the_pool_and_bad_cached_lengths(
    pages: list[int], cached: Any, says: str
) -> None:
    """Before anything runs: a page past the pool would be read and written outside it on the
    GPU. Spare pages past the context are not the forward's business."""
    net = build_model("tiny")
    pool = DevicePool.allocate(kv_geometry(net, 4), 16, "cpu")
    pool.buffer.normal_()
    before = pool.buffer.clone()
    run = ModelRunner(net, pool)
    with pytest.raises(ConfigError, match=re.escape(says)):
        run.forward([([1, 2], pages, cached)])
    assert torch.equal(pool.buffer, before)
    run.forward([([1, 2], [3, 4, 5, 99], 8)])  # page 99 lies past the 10 tokens: unused


def _staged_runners(
    monkeypatch: pytest.MonkeyPatch, num_pages: int = 16, max_graphs: int = 8
) -> tuple[ModelRunner, ModelRunner]:
    """(staged, eager) runners on CPU over pools of the same contents; the staged one runs
    the graph-replay path (stand-in graphs that run their body on the staged inputs)."""
    import hicache.engine.model as model

    def run(self: Any, into: torch.Tensor | None = None) -> torch.Tensor:
        if self.graph is None:
            self.graph = object()
        out = self._body()
        self.out = out
        return out.clone() if into is None else into.copy_(out)

    monkeypatch.setattr(model._Graph, "run", run)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    net = build_model("tiny")
    out = []
    for graphs in (True, False):
        pool = DevicePool.allocate(kv_geometry(net, 4), num_pages, "cpu")
        torch.manual_seed(0)
        pool.buffer.normal_()
        r = ModelRunner(net, pool, max_graphs=max_graphs, graph_bucket=16)
        r.graphs_enabled = graphs
        out.append(r)
    out[0]._staged_inputs = True
    out[0]._copied = [_NoEvent(), _NoEvent()]
    return out[0], out[1]


BAD_FORWARDS: list[Any] = [  # (tokens, pages, cached, what the error says)
    ([7], np.array([np.nan, 3.0, 5.0]), 5, "page nan is not an int"),  # NaN cast to int64 is page 0's slots
    ([7], np.array([-0.5, 3.0, 5.0]), 5, "page -0.5 is not an int"),
    ([7], [3, 4.0, 5], 5, "page 4.0 is not an int"),
    ([7], np.array([True, True, False]), 5, "page True is not an int"),
    ([7], [3, 2**70, 5], 5, f"page {2**70} is not an int in the pool"),
    ([7], np.array([3, 2**63 + 1, 5], dtype=np.uint64), 5, f"page {2**63 + 1} is not in the pool"),
    ([2.5], [3, 4, 5], 5, "new tokens must be ints, got 2.5"),
    ([True], [3, 4, 5], 5, "new tokens must be ints, got True"),
    ([-3], [3, 4, 5], 5, "token -3 is not in the vocabulary's [0, 512)"),
    ([512], [3, 4, 5], 5, "token 512 is not in the vocabulary's [0, 512)"),
    ([2**63 + 5], [3, 4, 5], 5, f"token {2**63 + 5} is not in the vocabulary"),
    ([7], [3, 4, 5], torch.tensor(True), "a cached length must be an int >= 0"),
    ([7], [3, 4, 5], np.bool_(True), "a cached length must be an int >= 0"),
    ([7], [3, 4, 5], torch.tensor(-1), "a cached length must be an int >= 0"),
]


@pytest.mark.parametrize("path", ["staged", "eager"])
@pytest.mark.parametrize(("tokens", "pages", "cached", "says"), BAD_FORWARDS)
def test_a_forward_refuses_what_is_not_an_int_on_every_path(
    monkeypatch: pytest.MonkeyPatch, path: str, tokens: Any, pages: Any, cached: Any, says: str
) -> None:
    """Pages, tokens and cached lengths that are not ints in range are a ConfigError before
    anything runs, on the staged replay path (every decode step's) as on the others: no page
    of the pool written (a NaN page would have been page 0, another request's), no graph made."""
    staged, eager = _staged_runners(monkeypatch)
    run = staged if path == "staged" else eager
    for r in (staged, eager):  # a context to extend: pages 3, 4, 5 hold tokens [0, 5)
        r.forward([([1, 2, 3, 4, 5], [3, 4, 5], 0)])
    before = run.pool.buffer.clone()
    made = len(run._graphs)
    with pytest.raises(ConfigError, match=re.escape(says)):
        run.forward([(tokens, pages, cached)])
    assert torch.equal(run.pool.buffer, before) and len(run._graphs) == made


@pytest.mark.parametrize("cached", [np.int64(5), np.int8(5), torch.tensor(5)])
def test_a_cached_length_of_another_int_type_is_the_int(monkeypatch: pytest.MonkeyPatch, cached: Any) -> None:
    """A numpy int or a 0-d integer tensor as the cached length runs as the same Python int:
    the same logits, and its graph reused (it does not key a new graph per call)."""
    staged, eager = _staged_runners(monkeypatch)
    for r in (staged, eager):
        r.forward([([1, 2, 3, 4, 5], [3, 4, 5], 0)])
    want = eager.forward([([7], [3, 4, 5], 5)])
    for _ in range(3):
        torch.testing.assert_close(staged.forward([([7], [3, 4, 5], cached)]), want, rtol=1e-4, atol=1e-4)
    assert staged.graph_replays == 3 and len(staged._graphs) == 1


def test_drain_after_the_last_request_puts_its_pages_in_l3() -> None:
    """An idle engine moves no backup along; ``engine.cache.drain()`` (ENGINE.md, before
    another instance reads the store) returns with every backup landed: the whole prompt's
    pages are in L3 and nothing is pending."""
    e = engine(write_policy="write_through")
    try:
        prompt = list(range(1, 40))  # 9 whole pages of 4
        e.generate(prompt, max_new_tokens=2)
        e.cache.drain()
        assert e.cache.status().pending_backups == 0
        assert e.cache.core.match(prompt).lengths[2] == 36
        e.cache.check_integrity()
    finally:
        e.close()
