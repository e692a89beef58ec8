"""The reference engine on CPU with the tiny model (float32)."""

from __future__ import annotations

import random

import pytest
import torch

from hicache.backends.pools import DevicePool
from hicache.engine import Engine, ModelRunner, build_model, kv_geometry
from hicache.spec.model import Tier

pytest.importorskip("transformers")


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_paged_attention_matches_stock_transformers(preset: str) -> None:
    """Full prefill, prefill over a cached prefix, and a decode step read from pages give
    the logits of the stock SDPA model."""
    net = build_model(preset)
    ref = build_model(preset)
    ref.config._attn_implementation = "sdpa"  # type: ignore[union-attr]
    pool = DevicePool.allocate(kv_geometry(net, 4), 32, "cpu")
    pool.buffer.normal_()  # garbage everywhere the request has not written
    run = ModelRunner(net, pool)
    toks = list(range(3, 40))
    pages = [5, 9, 2, 7, 11, 13, 1, 3, 4, 6]
    with torch.inference_mode():
        want = ref(input_ids=torch.tensor([toks])).logits[0, -1]
    torch.testing.assert_close(run.forward([(toks, pages, 0)])[0], want, rtol=1e-5, atol=1e-5)
    run.forward([(toks[:24], pages, 0)])
    torch.testing.assert_close(run.forward([(toks[24:], pages, 24)])[0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run.forward([(toks[36:], pages, 36)])[0], want, rtol=1e-5, atol=1e-5)


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
    prompt = [random.Random(1).randrange(512) for _ in range(50)]
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
        assert torch.equal(out.first_logits, l1.first_logits) and out.tokens == l1.tokens
    torch.testing.assert_close(first.first_logits, l1.first_logits, rtol=1e-5, atol=1e-5)
    assert first.tokens == l1.tokens
    e.cache.check_integrity()
    e.close()


def test_mixed_workload_keeps_integrity() -> None:
    """200 requests over shared and rotating prefixes, with L1 and L2 pressure."""
    rng = random.Random(0)
    e = engine(num_pages=48, l2_pages=40, l3_pages=96, policy="cost")
    prefixes = [[rng.randrange(512) for _ in range(rng.randrange(8, 60))] for _ in range(6)]
    for i in range(200):
        prompt = rng.choice(prefixes) + [rng.randrange(512) for _ in range(rng.randrange(0, 10))]
        e.generate(prompt, max_new_tokens=rng.randrange(1, 4))
        if i % 20 == 0:
            e.cache.check_integrity()
    e.cache.drain()
    st = e.cache.status()
    assert st["requests"] == 0 and st["core"]["leases"] == 0
    assert st["metrics"]["hit_tokens"]["L1"] > 0
    e.cache.check_integrity()
    e.close()
