"""Controller paths the random machines reach rarely, each pinned by a test of its own: a
promoted run that another request already brought to L1, a mover that cannot issue a copy,
refusals that name the call, and the documented derivation of page keys."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash

from hicache import HiCache, HiCacheConfig
from hicache.core.geometry import KVGeometry
from hicache.core.keys import FORMAT_VERSION, format_seed, page_keys
from hicache.errors import IntegrityError, MisuseError
from hicache.spec.request import ReqState
from hicache.testing.explore_requests import CONFIGS

G = KVGeometry(2, 2, 8, 2, torch.float32)


def test_a_promoted_run_already_in_l1_is_published_from_l1() -> None:
    """Request 1 restores prefix [1] from L3 while request 0 computes and inserts the same
    prefix into L1: when the read lands, request 1 is published over request 0's L1 page
    (the run is already there), with the right content and every invariant held."""
    system = CONFIGS["wt-warm"].system()  # sequence 0 = (1, 2) computed, backed up, released
    for action in ("evict:L1", "admit:0", "allocate:0", "evict:L2", "admit:1", "restore:1", "insert:0"):
        system.apply(action)
        assert system.check() == [], action
    req1 = system.live[1]
    assert req1.state is ReqState.LOADING_L3
    system.apply("complete:0")  # the S2H lands; the run already has an L1 copy
    assert system.check() == []
    state: ReqState = req1.state  # NOTE: re-read: complete:0 moved it
    assert state is ReqState.READY and req1.cached_len == 1
    assert system.controller.prefix_pages(req1) == system.controller.prefix_pages(system.live[0])[:1]


def make() -> HiCache:
    return HiCache(HiCacheConfig(G, l1_pages=8, l2_pages=8, l3_pages=16, device="cpu", policy="always"))


def test_a_mover_that_cannot_issue_fails_the_transfer_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """A D2H the mover cannot issue (it raises) is a failed transfer: counted, the run keeps
    its L1 copy only, the cache stays consistent, and the next backup goes through."""
    with make() as cache:

        def refuse(*args: object, **kwargs: object) -> None:
            raise RuntimeError("no copy engine")

        monkeypatch.setattr(cache.device, "d2h", refuse)
        req = cache.admit([1, 2, 3, 4])
        pages = cache.allocate(req, 2)
        assert pages is not None
        cache.insert(req, pages)
        cache.release(req)
        cache.check_integrity()
        assert cache.status().metrics["directions"]["D2H"]["failed"] == 1
        other = cache.admit([7, 8])
        page = cache.allocate(other, 1)
        assert page is not None
        cache.insert(other, page)
        cache.release(other)
        assert cache.status().metrics["directions"]["D2H"]["failed"] == 2  # counted, not set
        again = cache.admit([1, 2, 3, 4])
        assert again.hit == (4, 0, 0)
        cache.release(again)
        monkeypatch.undo()
        req = cache.admit([1, 2, 3, 4, 5, 6])
        pages = cache.allocate(req, 1)
        assert pages is not None
        cache.insert(req, pages)
        cache.release(req)
        cache.drain()
        cache.check_integrity()
        assert cache.admit([1, 2, 3, 4, 5, 6]).hit[1] == 6  # the path is in L2 now


def test_refusals_name_the_call() -> None:
    """A call the request's state does not allow, or bad pages, is refused with the call's
    name first, so the user sees which of their calls was wrong."""
    with make() as cache:
        req = cache.admit([1, 2, 3, 4])
        pages = cache.allocate(req, 2)
        assert pages is not None
        with pytest.raises(MisuseError, match=r"^insert: pages must be distinct private pages"):
            cache.insert(req, [pages[0], pages[0]])
        cache.insert(req, pages)
        with pytest.raises(MisuseError, match=r"^insert: request #\d+ is running"):
            cache.insert(req, [])
        cache.release(req)
    system = CONFIGS["wt-warm"].system()
    for action in ("evict:L1", "evict:L2", "admit:1", "restore:1"):
        system.apply(action)
    with pytest.raises(MisuseError, match=r"^allocate: request #\d+ is loading_l3"):
        system.controller.allocate(system.live[1], 1)


def test_page_keys_follow_the_documented_derivation() -> None:
    """The seed is xxh3-128 over length-prefixed fields (docs/DESIGN.md §6b); each page's key
    is xxh3-128 of its parent's key and its tokens as little-endian int64. Recomputed here from
    that description: stores written by one build are found by the next."""
    fields = ["hicache-kv", f"v{FORMAT_VERSION}", "m", "", "layers=2", "kv_heads=2", "head_dim=8", "page=2"]
    fields.append(f"dtype={G.dtype}")
    blob = b"".join(len(f.encode()).to_bytes(4, "little") + f.encode() for f in fields)
    seed = xxhash.xxh3_128_digest(blob)
    assert format_seed("m", G) == seed
    tokens = [5, -1, 2**40, 7, 9]
    want, key = [], seed
    for i in range(0, 4, 2):
        key = xxhash.xxh3_128_digest(key + struct.pack("<2q", *tokens[i : i + 2]))
        want.append(key)
    assert page_keys(seed, tokens, 2) == want
    with pytest.raises(MisuseError, match="page_size must be a positive int"):
        page_keys(seed, tokens, 0)


def test_a_broken_request_invariant_is_named_by_check_integrity() -> None:
    """check_integrity() raises IntegrityError naming the request invariant that broke."""
    with make() as cache:
        req = cache.admit([1, 2, 3, 4])
        pages = cache.allocate(req, 2)
        assert pages is not None
        cache.insert(req, pages)
        req.cached_len = 1  # corrupt: not page aligned
        with pytest.raises(IntegrityError) as info:
            cache.check_integrity()
        assert info.value.invariant == "request-cached"
        req.cached_len = 4
