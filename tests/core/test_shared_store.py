"""A shared, keyed L3 through the facade: pages another instance stored are discovered and
restored bit-exactly; pages that vanish are forgotten and the request recomputes; pages the
store has are not written again; an unreachable store is no L3."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.backends.pools import HostPool
from hicache.core.geometry import KVGeometry
from hicache.core.keys import format_seed, page_keys
from hicache.errors import ConfigError
from hicache.spec.model import Tier
from hicache.testing.memory_store import MemoryStore
from tests.threads import named, settle

G = KVGeometry(2, 2, 8, 2, torch.float32)
MODEL = "test-model"


def make(store: MemoryStore | None = None, **kw: object) -> tuple[HiCache, MemoryStore]:
    made: list[MemoryStore] = []

    def build(host: HostPool) -> MemoryStore:
        s = MemoryStore(host)
        if store is not None:  # another instance on the same store: share its pages
            s.pages, s._lock = store.pages, store._lock
        made.append(s)
        return s

    cfg: dict[str, object] = dict(
        geometry=G, l1_pages=8, l2_pages=8, l3_pages=16, policy="always", device="cpu", tracing=True, model_id=MODEL
    )
    cfg.update(kw)
    c = HiCache(HiCacheConfig(**cfg), store=build)  # type: ignore[arg-type]
    return c, made[0]


def compute(c: HiCache, tokens: list[int], seed: int) -> torch.Tensor:
    """Prefill ``tokens`` with seeded random K/V, insert, release, drain; their prefix's K/V."""
    ps = c.config.geometry.page_size
    req = c.admit(tokens)
    pages = c.allocate(req, len(tokens) // ps - req.cached_len // ps)
    assert pages is not None
    c.l1.buffer[:, :, pages] = torch.randn(
        c.l1.buffer[:, :, pages].shape, generator=torch.Generator().manual_seed(seed)
    )
    c.insert(req, pages)
    kv = c.l1.buffer[:, :, c.prefix_pages(req)].clone()
    c.release(req)
    c.drain()
    return kv


def test_a_second_instance_restores_what_the_first_stored_bit_exactly() -> None:
    a, store = make()
    toks = list(range(10))
    kv = compute(a, toks, seed=1)
    assert len(store.pages) == 5
    b, mine = make(store)
    req = b.admit(toks)
    assert req.hit == (0, 0, 10) and b.metrics.l3_discovered_pages == 5
    assert b.restore(req, b.plan(req))
    assert req.cached_len == 10 and torch.equal(b.l1.buffer[:, :, b.prefix_pages(req)], kv)
    b.check_integrity()
    b.release(req)
    compute(b, [*toks, 50, 51], seed=2)  # extends it: only the new page is written
    assert mine.puts == 1 and len(store.pages) == 6
    a.close()
    b.close()


def test_a_page_that_vanished_fails_the_restore_and_is_forgotten() -> None:
    a, store = make()
    toks = list(range(10))
    compute(a, toks, seed=1)
    b, _ = make(store)
    keys = page_keys(format_seed(MODEL, G), toks, G.page_size)
    req = b.admit(toks)  # discovers all five pages
    assert req.hit[2] == 10
    store.drop(keys[3])  # another instance evicts page 3 meanwhile
    assert not b.restore(req, b.plan(req))
    assert req.cached_len == 0 and b.metrics.fallbacks == 1 and b.metrics.l3_lost_runs == 1
    assert b.core.match(toks).lengths == (0, 0, 0)  # forgotten, nothing stale kept
    b.check_integrity()
    b.release(req)
    again = b.admit(toks)  # the store still has pages 0-2: discovered again
    assert again.hit[2] == 6
    b.release(again)
    b.check_integrity()
    a.close()
    b.close()


def test_an_extension_is_discovered_below_what_the_tree_has() -> None:
    """The tree holds a prefix locally; the store holds it and more: the runs without an L3
    copy gain one, the rest becomes a new run, and the restore reads just the rest."""
    a, store = make()
    base, more = list(range(6)), [*list(range(6)), 7, 7, 8, 8]
    compute(a, more, seed=3)
    b, _ = make(store)
    kv = compute(b, base, seed=4)  # b computes the prefix itself (same tokens, its own bytes)
    b.core.evict(Tier.L2, 10**6)
    req = b.admit(more)
    assert req.hit == (6, 0, 10)
    assert b.restore(req, b.plan(req)) and req.cached_len == 10
    assert torch.equal(b.l1.buffer[:, :, b.prefix_pages(req)[:3]], kv)
    b.check_integrity()
    b.release(req)
    a.close()
    b.close()


def test_an_unavailable_store_is_no_l3() -> None:
    class Down(MemoryStore):
        @property
        def available(self) -> bool:
            return False

    c = HiCache(
        HiCacheConfig(G, l1_pages=8, l2_pages=8, l3_pages=16, policy="always", device="cpu", model_id=MODEL),
        store=lambda host: Down(host),
    )
    compute(c, list(range(8)), seed=5)
    c.core.evict(Tier.L1, 10**6)
    c.core.evict(Tier.L2, 10**6)
    req = c.admit(list(range(8)))
    assert c.plan(req).tier is Tier.L1 and c.metrics.l3_unavailable >= 1
    c.release(req)
    c.close()


def test_a_keyed_store_needs_the_model_identity() -> None:
    with pytest.raises(ConfigError, match="model_id"):
        HiCache(HiCacheConfig(G, l1_pages=4, l2_pages=4, l3_pages=4, device="cpu"), store=lambda h: MemoryStore(h))
    with pytest.raises(ConfigError, match="model_id"):
        HiCacheConfig(G, l1_pages=4, l2_pages=4, l3_pages=4, device="cpu", storage_backend="dir", storage_path="/tmp")


def test_different_models_never_share_pages() -> None:
    a, store = make()
    compute(a, list(range(8)), seed=6)
    b, _ = make(store, model_id="another-model")
    req = b.admit(list(range(8)))
    assert req.hit == (0, 0, 0)
    b.release(req)
    a.close()
    b.close()


class _Junk(MemoryStore):
    """A store whose answers are not what the protocol says, one way per ``mode``."""

    mode = ""

    def plan(self, op: str, host_pages: object, slots: list[int]) -> tuple[list[tuple[int, int]], int]:  # type: ignore[override]
        if self.mode == "plan empty":
            return [], 0
        if self.mode == "plan partial" and len(slots) > 1:
            return [(0, 1)], 1
        if self.mode == "plan backwards" and len(slots) > 1:
            return [(1, len(slots)), (0, 1)], 2
        return super().plan(op, host_pages, slots)  # type: ignore[arg-type]

    def put(self, host_pages: list[int], slots: list[int], keys: list[bytes] | None) -> list[object]:  # type: ignore[override]
        out = super().put(host_pages, slots, keys)
        return ["OK"] * len(out) if self.mode == "put strings" else list(out)

    def get(self, host_pages: list[int], slots: list[int], keys: list[bytes] | None) -> list[object]:  # type: ignore[override]
        out = super().get(host_pages, slots, keys)
        return [99] * len(out) if self.mode == "get numbers" else list(out)


@pytest.mark.parametrize("mode", ["put strings", "get numbers", "plan empty", "plan partial", "plan backwards"])
def test_a_store_answering_junk_fails_its_requests_and_keeps_every_io_thread(mode: str) -> None:
    """Statuses that are no PageStatus or a plan that does not cover the pages in order fail
    that request (its prompt recomputes); they used to raise on an I/O thread and end it, and
    with all four ended every L3 request ran to its deadline for the cache's life."""

    def build(host: HostPool) -> MemoryStore:
        s = _Junk(host)
        s.mode = mode
        return s

    cfg = HiCacheConfig(
        G, l1_pages=4, l2_pages=4, l3_pages=32, policy="always", device="cpu", model_id=MODEL, storage_deadline_s=60.0
    )
    settle()  # no earlier test's dropped cache closes its threads while these are counted
    c = HiCache(cfg, store=build)

    def l3_threads() -> int:
        return named("hicache-l3")

    before = l3_threads()
    prompts = [[100 * k + j for j in range(2 * G.page_size)] for k in range(6)]
    for k, tokens in enumerate(prompts):  # each pushes older ones out of L1 and L2: L3 writes
        compute(c, tokens, seed=k)
        c.drain()
    for tokens in prompts[:3]:  # in L3 alone (if written): reads
        again = c.admit([*tokens[: G.page_size], 9, 9])
        c.restore(again)
        c.release(again)
        c.drain()
        c.check_integrity()
    assert l3_threads() == before > 0
    storage = c.status().storage
    assert storage is not None and storage["failed"] > 0
    c.close()


def test_a_dir_store_whose_directory_was_removed_is_no_l3(tmp_path: Path) -> None:
    """``rm -r`` of a dir store's directory under a running cache: the store reports itself
    unavailable (with why), restores stop planning from L3 and backups are skipped, nothing
    raises, and the pages still in L2 restore bit-exactly."""
    path = tmp_path / "l3"
    cfg = dict(l1_pages=8, l2_pages=8, l3_pages=16, policy="always", device="cpu", model_id=MODEL)
    c = HiCache(HiCacheConfig(G, **cfg, storage_backend="dir", storage_path=str(path)))  # type: ignore[arg-type]
    kv = compute(c, list(range(8)), seed=7)
    assert c.storage is not None and c.storage.available and c.core.match(list(range(8))).lengths[2] == 8
    shutil.rmtree(path)
    st = c.status().storage
    assert st is not None and st["available"] is False
    assert st["error"] == f"L3 directory {path} was removed"
    c.core.evict(Tier.L1, 10**6)
    req = c.admit(list(range(8)))
    assert c.plan(req).tier is Tier.L2  # L3 is out of the plan; L2 still serves
    assert c.restore(req) and torch.equal(c.l1.buffer[:, :, c.prefix_pages(req)], kv)
    c.release(req)
    before = c.metrics.l3_unavailable
    compute(c, list(range(100, 108)), seed=8)  # its backup to L3 is skipped, not failed mid-write
    assert c.metrics.l3_unavailable > before
    c.check_integrity()
    c.close()


@pytest.mark.parametrize("verify", [False, True])
def test_pages_found_in_slots_this_cache_freed_restore_under_verification(verify: bool) -> None:
    """Another instance's prompt, discovered into L3 slots this cache used for its own
    backups and evicted since: with ``verify_pages`` it restores bit-exactly, as without
    (the verifier kept the old pages' digests for those slots and failed every restore)."""
    a, store = make()
    prompt = list(range(500, 516))
    kv = compute(a, prompt, seed=11)
    a.close()
    b, _ = make(store, l3_pages=8, verify_pages=verify)
    for first in (600, 700, 800):  # b's own prompts: its 8 L3 slots fill and turn over
        compute(b, list(range(first, first + 16)), seed=first)
    for _ in range(2):
        b.core.evict(Tier.L1, 10**6)
        b.core.evict(Tier.L2, 10**6)
        req = b.admit(prompt)
        assert req.hit == (0, 0, 16) and b.restore(req), b.status().metrics["verify_failures"]
        assert torch.equal(b.l1.buffer[:, :, b.prefix_pages(req)], kv)
        b.release(req)
    assert b.metrics.verify_failures == 0
    b.check_integrity()
    b.close()


def test_ranks_of_one_model_never_share_pages() -> None:
    """Tensor-parallel ranks hold different KV heads in the same geometry: with their shard
    named, rank 1 on rank 0's store finds none of rank 0's pages; the same shard finds them."""
    a, store = make(shard="tp0/2")
    compute(a, list(range(8)), seed=6)
    for shard, hit in (("tp1/2", 0), ("", 0), ("tp0/2", 8)):
        b, _ = make(store, shard=shard)
        req = b.admit(list(range(8)))
        assert req.hit[2] == hit, shard
        b.release(req)
        b.close()
    a.close()


@pytest.mark.parametrize("shard", [3, None, "\ud800"])
def test_a_shard_that_is_not_text_is_refused(shard: object) -> None:
    with pytest.raises(ConfigError, match="shard must be a str of text"):
        HiCacheConfig(G, l1_pages=8, model_id=MODEL, shard=shard)  # type: ignore[arg-type]


def test_a_shard_without_the_model_identity_is_refused() -> None:
    with pytest.raises(ConfigError, match="set model_id too"):
        HiCacheConfig(G, l1_pages=8, shard="tp0/2")
