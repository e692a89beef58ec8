"""What a cache computed reaches a store that outlives it, whatever the write policy:
``close`` flushes L1 and L2 to a persistent store (``write_back`` and
``write_through_selective`` back up only what L1 evicts or what is hit often enough), so a
restarted cache restores every prompt bit-exactly; ``flush`` does it on demand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.core.geometry import KVGeometry
from hicache.spec.model import Tier
from tests.core.test_shared_store import compute

G = KVGeometry(2, 1, 4, 2, torch.float32)
PROMPTS = [list(range(s, s + 8)) for s in (0, 100, 200)] + [
    [*range(8), 50, 51, 52, 53]
]  # 4, 4, 4, 6 pages (2 tokens a page)


def cache(path: Path, policy: str, l2_pages: int = 16) -> HiCache:
    sizes = HiCacheConfig(G, l1_pages=16, l2_pages=l2_pages, l3_pages=32, device="cpu", policy="always")
    l3 = dataclasses.replace(sizes, storage_backend="dir", storage_path=str(path), model_id="m")
    return HiCache(dataclasses.replace(l3, write_policy=policy))


@pytest.mark.parametrize("l2_pages", [16, 6], ids=["l2-roomy", "l2-of-the-longest-path"])
@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_a_restarted_cache_restores_every_prompt_the_last_one_computed(
    tmp_path: Path, policy: str, l2_pages: int
) -> None:
    path = tmp_path / "l3"
    first = cache(path, policy, l2_pages)
    kvs = [compute(first, p, seed=i) for i, p in enumerate(PROMPTS)]
    first.close()
    with cache(path, policy, l2_pages) as again:
        for p, kv in zip(PROMPTS, kvs, strict=True):
            req = again.admit(p)
            assert req.hit[2] == len(p), (p, req.hit)  # (the last shares the first's first 8 tokens)
            assert again.restore(req)
            assert torch.equal(again.l1.buffer[:, :, again.prefix_pages(req)], kv)
            again.release(req)
        again.check_integrity()


def test_flush_writes_what_write_back_left_in_l1_and_counts_it(tmp_path: Path) -> None:
    with cache(tmp_path / "l3", "write_back") as c:
        for i, p in enumerate(PROMPTS[:2]):
            compute(c, p, seed=i)
        assert all(c.core.match(p).lengths == (8, 0, 0) for p in PROMPTS[:2])
        assert c.flush() == 2
        assert all(c.core.match(p).lengths == (8, 8, 8) for p in PROMPTS[:2])
        assert c.flush() == 0  # nothing left to write
        c.check_integrity()
        c.core.evict(Tier.L1, 10**6)
        c.core.evict(Tier.L2, 10**6)
        assert c.admit(PROMPTS[0]).hit == (0, 0, 8)


def test_close_does_not_flush_a_store_that_goes_with_the_cache() -> None:
    """The default file store vanishes with the cache: close writes nothing more to it."""
    c = HiCache(HiCacheConfig(G, l1_pages=16, l2_pages=8, l3_pages=32, device="cpu", write_policy="write_back"))
    compute(c, PROMPTS[0], seed=0)
    c.close()
    assert c.metrics.directions["H2S"].count == 0


@pytest.mark.parametrize("how", ["close", "flush"])
def test_a_hung_store_ends_the_flush_at_the_first_write_past_its_deadline(tmp_path: Path, how: str) -> None:
    """write_back leaves three runs in L1 only; the store's writes hang. The flush (its own,
    or close's) waits out one write's deadline, then stops: a deadline per run would hold
    close for as many deadlines as there are runs. The runs stay consistent in L1."""
    c = cache(tmp_path / "l3", "write_back")
    c.controller.storage.close_timeout_s = 0.05  # type: ignore[union-attr]
    c.controller.storage.deadline_s = 0.05  # type: ignore[union-attr]
    for i, p in enumerate(PROMPTS[:3]):
        compute(c, p, seed=i)
    c.faults.add("hang", 1000, op="write")
    try:
        if how == "flush":
            assert c.flush() == 0
            c.check_integrity()
            assert all(c.core.match(p).lengths[0] == 8 for p in PROMPTS[:3])
        c.close()
        assert c.metrics.l3_deadline_failures == 1
    finally:
        c.faults.release()


def test_a_run_larger_than_all_of_l2_is_skipped_and_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A 6-page prompt over a 4-page L2 can never be staged: skipped (counted), and one
    warning names the sizes, however many times it happens; a prompt that fits says nothing."""
    with (
        caplog.at_level("WARNING", logger="hicache.core.controller"),
        cache(tmp_path / "l3", "write_through", l2_pages=4) as c,
    ):
        compute(c, PROMPTS[0][:6], seed=0)  # 3 pages: fits
        c.drain()
        assert not [r for r in caplog.records if "larger than all" in r.getMessage()]
        assert c.core.match(PROMPTS[0][:6]).lengths == (6, 6, 6)
        for i, p in enumerate(PROMPTS[1:3]):  # 4 pages each: all of L2, which fits
            compute(c, p, seed=i + 1)
        c.drain()
        assert not [r for r in caplog.records if "larger than all" in r.getMessage()]
        skipped = c.status().metrics["backups_skipped"]
        for i in range(2):
            compute(c, [*range(300 + 20 * i, 312 + 20 * i)], seed=10 + i)  # 6 pages
        c.drain()
        assert c.status().metrics["backups_skipped"] == skipped + 2
        said = [r.getMessage() for r in caplog.records if "larger than all" in r.getMessage()]
        assert said == [
            "hicache: a run of 6 pages is larger than all of L2 (4 pages): it is not backed up; "
            "give L2 at least as many pages as the longest prompt (L1's)"
        ]
        c.check_integrity()
