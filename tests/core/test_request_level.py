"""The request level: the declared request lifecycle, check-then-commit restores, and what
they guarantee (prompts around a page, room-making, validation, no leftover bookkeeping)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.core.controller import PendingRestore, Request
from hicache.core.geometry import DevicePage, KVGeometry
from hicache.core.node import Lease
from hicache.errors import ConfigError, HandleError, MisuseError
from hicache.spec.model import Direction, Tier
from hicache.spec.request import ReqState

G = KVGeometry(2, 2, 8, 2, torch.float32)
POLICIES = ["write_through", "write_through_selective", "write_back"]


def make(**kw: object) -> HiCache:
    cfg: dict[str, object] = dict(geometry=G, l1_pages=8, l2_pages=8, l3_pages=16, policy="always", device="cpu")
    cfg.update(tracing=True)
    cfg.update(kw)
    return HiCache(HiCacheConfig(**cfg))  # type: ignore[arg-type]


def content(c: HiCache, pages: Sequence[int]) -> torch.Tensor:
    return c.l1.buffer[:, :, pages].clone()


def prefill(c: HiCache, tokens: list[int], seed: int = 0) -> tuple[Request, torch.Tensor]:
    """Admit, allocate, 'compute' KV into the private pages, insert; the KV of the prefix."""
    req = c.admit(tokens)
    ps = G.page_size
    n = -(-len(tokens) // ps) - req.cached_len // ps
    pages = c.allocate(req, n)
    assert pages is not None
    g = torch.Generator().manual_seed(seed)
    c.l1.buffer[:, :, pages] = torch.randn(c.l1.buffer[:, :, pages].shape, generator=g)
    c.insert(req, pages[: len(tokens) // ps - req.cached_len // ps])
    return req, content(c, c.prefix_pages(req))


def settle(c: HiCache) -> None:
    c.drain()
    c.check_integrity()


# -- prompts around a page ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("length", [1, 2, 3, 5])  # page size 2: page-1, page, page+1, more
def test_prompts_around_a_page_go_through_the_whole_lifecycle(length: int, policy: str) -> None:
    """Prompts of 1, page-1, page, page+1 tokens (and more): admit, allocate, insert, release
    under every write policy; a prompt shorter than a page inserts nothing and holds its
    private page until released; the same prompt again hits what was inserted."""
    c = make(write_policy=policy)
    tokens = list(range(10, 10 + length))
    req, _ = prefill(c, tokens)
    assert req.state is ReqState.RUNNING
    assert req.cached_len == length - length % G.page_size
    assert len(req.private) == (1 if length % G.page_size else 0)
    c.check_integrity()
    c.release(req)
    settle(c)
    again = c.admit(tokens)
    assert again.cached_len == length - length % G.page_size
    c.release(again)
    assert c.status().core.tiers[0].private == 0 and c.status().core.leases == 0
    c.close()


def test_an_empty_prompt_is_refused_at_admit() -> None:
    c = make()
    with pytest.raises(MisuseError, match="empty"):
        c.admit([])
    assert c.status().requests == 0
    c.close()


# -- room-making never evicts what the decision needs ------------------------------------------


@pytest.mark.parametrize("source", [Tier.L2, Tier.L3])
def test_write_back_restore_does_not_evict_its_own_source(source: Tier) -> None:
    """write_back, L1 and L2 of 4 pages: making L1 room for A's restore backs up B, and the
    room that backup needs must not come from A's copy being read (it is pinned first)."""
    c = make(l1_pages=4, l2_pages=4, l3_pages=8 if source is Tier.L3 else 0, write_policy="write_back")
    a = list(range(8))
    b = list(range(100, 108))
    ra, kv_a = prefill(c, a, seed=1)
    c.release(ra)
    rb, _ = prefill(c, b, seed=2)  # evicts A from L1, backing it up to L2 first
    c.release(rb)
    settle(c)
    if source is Tier.L3:
        c.core.evict(Tier.L2, 10**6)
        assert c.core.match(a).lengths == (0, 0, 8)
    assert c.core.match(a).lengths[source] == 8
    req = c.admit(a)
    assert c.restore(req, c.plan(req))
    assert req.cached_len == 8 and torch.equal(content(c, c.prefix_pages(req)), kv_a)
    c.check_integrity()
    c.release(req)
    c.close()


def test_write_back_evicts_exactly_the_victim_it_backed_up() -> None:
    """The LRU victim is backed up to L2 and then that victim — not another run with no
    L2 copy — is evicted: no prefix is lost from every tier."""
    c = make(l1_pages=4, l2_pages=8, l3_pages=0, write_policy="write_back")
    x, y = [1, 1, 1, 1], [2, 2, 2, 2]
    rx, kv_x = prefill(c, x, seed=1)
    c.release(rx)
    ry, _ = prefill(c, y, seed=2)
    c.release(ry)
    assert c.core.match(x).lengths == (4, 0, 0) and c.core.match(y).lengths == (4, 0, 0)
    z = c.admit([3, 3])
    assert c.allocate(z, 2) is not None  # two pages: X (the older) goes
    assert c.core.match(x).lengths == (0, 4, 0)
    assert c.core.match(y).lengths == (4, 0, 0)
    c.release(z)
    req = c.admit(x)
    assert c.restore(req, c.plan(req)) and torch.equal(content(c, c.prefix_pages(req)), kv_x)
    c.release(req)
    c.close()


def test_a_backup_does_not_evict_its_own_parent() -> None:
    """Making L2 room for a child's D2H must not drop the parent's L2 copy (an L2 leaf that
    is the LRU one): the parent is pinned before room is made."""
    c = make(l1_pages=8, l2_pages=4, l3_pages=0)
    p, q = [1, 1, 2, 2], [5, 5, 6, 6]
    for toks in (p, q):
        r, _ = prefill(c, toks)
        c.release(r)
        settle(c)
    assert c.core.match(p).l2.length == 4 and c.core.match(q).l2.length == 4  # L2 full, P older
    r, _ = prefill(c, [*p, 3, 3])
    c.release(r)
    settle(c)
    assert c.core.match([*p, 3, 3]).l2.length == 6  # the extension backed up, its parent kept
    assert c.metrics.backups_skipped == 0
    c.close()


# -- an extension inserted while its parent's backup is in flight ------------------------------


def test_an_extension_inserted_during_its_parents_backup_is_backed_up() -> None:
    """A prefix extended while its parent's D2H is still in flight (the usual multi-turn case
    on a GPU) is backed up once the parent lands — not silently skipped."""
    c = make(l3_pages=0)
    parent = [1, 2, 3, 4]
    r1, _ = prefill(c, parent)  # its D2H is issued; poll has not seen it finish
    assert c.status().pending_backups == 1
    r2, _ = prefill(c, [*parent, 5, 6])
    c.release(r1)
    c.release(r2)
    settle(c)
    assert c.core.match([*parent, 5, 6]).l2.length == 6
    assert c.metrics.backups_skipped == 0
    c.close()


# -- a restore lists exactly its own prefix ----------------------------------------------------


def test_a_restore_that_ends_inside_a_run_moves_and_names_only_its_prefix() -> None:
    """A prompt sharing 4 tokens of an 8-token run restores 2 pages, not 4; the layered page
    list is exactly the 2 pages its prefix has once published."""
    c = make()
    run = list(range(8))
    r, kv = prefill(c, run)
    c.release(r)
    settle(c)
    c.core.evict(Tier.L1, 10**6)
    req = c.admit([*run[:4], 90, 91])
    assert req.hit == (0, 4, 4)
    pending = c.start_restore(req, c.plan(req), layer_events=())
    assert pending is not None and pending.pages is not None and len(pending.pages) == 2
    assert pending.transfer is not None and len(pending.transfer.dst) == 2
    c.check_integrity()
    while not pending.finished:
        c.poll()
    assert pending.done and req.cached_len == 4 and c.prefix_pages(req) == pending.pages
    assert torch.equal(content(c, pending.pages), kv[:, :, :2])
    c.release(req)
    c.check_integrity()
    c.close()


# -- configuration validated before anything is opened -----------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    "bad",
    [
        {"storage_workers": 0},
        {"storage_workers": -1},
        {"selective_hits": 0},
        {"write_policy": "write_sideways"},
        {"policy": "sometimes"},
        {"device": "tpu"},
        {"checksums": "yes"},
        {"l2_pages": 10**13},
    ],
)
def test_bad_configuration_is_refused_before_anything_is_opened(bad: dict[str, object]) -> None:
    before = _fds()
    with pytest.raises(ConfigError):
        make(**bad)
    assert _fds() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_cuda_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="CUDA"):
        make(device="cuda")


# -- typed errors for every bad argument, nothing changed --------------------------------------


def _inference_zeros(shape: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(shape)


@pytest.mark.parametrize(
    "buffer",
    [
        lambda: torch.zeros((2, 2, 8, 2, 2, 8), requires_grad=True),
        lambda: np.zeros((2, 2, 8, 2, 2, 8), dtype=np.float32),
        lambda: torch.zeros((2, 2, 8, 2, 2, 8), dtype=torch.float16),
        lambda: torch.zeros((2, 2, 7, 2, 2, 8)),
        lambda: [torch.zeros(4)],
        lambda: _inference_zeros((2, 2, 8, 2, 2, 8)),
    ],
)
def test_a_bad_l1_buffer_is_a_config_error(buffer: Callable[[], object]) -> None:
    with pytest.raises(ConfigError):
        HiCache(HiCacheConfig(G, l1_pages=8, device="cpu"), l1_buffer=buffer())  # type: ignore[arg-type]


def test_every_entry_point_refuses_bad_arguments_and_changes_nothing() -> None:
    c = make()
    req, _ = prefill(c, list(range(6)))
    c.release(req)
    settle(c)
    c.core.evict(Tier.L1, 10**6)
    req = c.admit(list(range(6)))
    before = (c.status().to_dict(), req.state, req.cached_len)
    calls: list[Callable[[], object]] = [
        lambda: c.allocate(req, "2"),  # type: ignore[arg-type]
        lambda: c.allocate(req, -1),
        lambda: c.allocate(req, True),
        lambda: c.start_restore(req, "L2"),  # type: ignore[arg-type]
        lambda: c.start_restore(req, layer_events="abc"),
        lambda: c.insert(req, [DevicePage(10**6)]),
        lambda: c.insert(req, "ab"),  # type: ignore[arg-type]
        lambda: c.release("request"),  # type: ignore[arg-type]
        lambda: c.prefix_pages(None),  # type: ignore[arg-type]
        lambda: c.observe_prefill(0, 1.0),
        lambda: c.observe_prefill(5, float("nan")),
        lambda: c.observe_prefill(5, -1.0),
        lambda: c.note_decode(float("inf")),
        lambda: c.note_decode("1"),  # type: ignore[arg-type]
        lambda: c.admit("abc"),
        lambda: c.admit([1.5, 2]),
    ]
    for call in calls:
        with pytest.raises(MisuseError):
            call()
    assert (c.status().to_dict(), req.state, req.cached_len) == before
    c.check_integrity()
    c.close()


def test_a_request_refuses_what_its_state_does_not_allow() -> None:
    """Per the request model: no restore after allocate, no second insert, no insert while a
    restore is in flight, nothing after release; each raises MisuseError."""
    c = make()
    r, _ = prefill(c, list(range(4)))
    with pytest.raises(MisuseError):
        c.insert(r, [])  # RUNNING: inserted already
    with pytest.raises(MisuseError):
        c.start_restore(r)
    c.release(r)
    with pytest.raises(HandleError):
        c.release(r)
    with pytest.raises(HandleError):
        c.allocate(r, 1)
    settle(c)
    c.core.evict(Tier.L1, 10**6)
    c.faults.add("slow", op="read", delay_s=0.01)
    r = c.admit(list(range(4)))
    pending = c.start_restore(r)
    assert pending is not None and r.state in (ReqState.LOADING_L2, ReqState.LOADING_L3)
    with pytest.raises(MisuseError):
        c.insert(r, [])
    c.release(r)
    settle(c)
    c.close()


def test_every_call_checks_closed_and_thread() -> None:
    c = make()
    req = c.admit([1, 2, 3, 4])
    errors: list[BaseException] = []

    def other() -> None:
        for call in (lambda: c.prefix_pages(req), lambda: c.observe_prefill(4, 0.1), lambda: c.note_decode(0.1)):
            try:
                call()
            except MisuseError as exc:
                errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 3
    c.close()
    for call in (
        lambda: c.prefix_pages(req),
        lambda: c.observe_prefill(4, 0.1),
        lambda: c.note_decode(0.1),
        lambda: c.drain(),
        lambda: c.admit([1]),
        lambda: c.status(),
    ):
        with pytest.raises(MisuseError, match="closed"):
            call()
    c.close()  # idempotent


# -- no bookkeeping that outlives the runs -----------------------------------------------------


def _bookkeeping(c: HiCache) -> int:
    return sum(len(v) for v in vars(c.controller).values() if isinstance(v, (dict, set, list)))


def test_selective_bookkeeping_does_not_grow_with_runs_ever_hit() -> None:
    """Hit counts live on the tree's runs: they go when the runs go."""
    sizes = []
    for n in (5, 40):
        c = make(write_policy="write_through_selective", selective_hits=3, l3_pages=0)
        for i in range(n):
            toks = [i % 7, i, i + 1, 3]
            r, _ = prefill(c, toks)
            c.release(r)
            c.release(c.admit(toks))
            c.core.evict(Tier.L1, 10**6)
        sizes.append(_bookkeeping(c))
        c.close()
    assert sizes[0] == sizes[1]


def test_selective_backs_up_only_after_enough_hits_and_write_back_never_early() -> None:
    """A policy does not back up what it must not: selective waits for N hits, write_back
    waits for eviction."""
    c = make(write_policy="write_through_selective", selective_hits=2)
    toks = [7, 7, 8, 8]
    r, _ = prefill(c, toks)
    c.release(r)
    settle(c)
    assert c.core.match(toks).l2.length == 0
    c.release(c.admit(toks))  # hit 1
    settle(c)
    assert c.core.match(toks).l2.length == 0
    c.release(c.admit(toks))  # hit 2: backed up
    settle(c)
    assert c.core.match(toks).lengths == (4, 4, 4)
    c.close()
    c = make(write_policy="write_back")
    r, _ = prefill(c, toks)
    c.release(r)
    settle(c)
    assert c.core.match(toks).lengths == (4, 0, 0)
    c.close()


# -- bookkeeping: at most two tree walks per request -------------------------------------------


@pytest.mark.parametrize("source", [None, Tier.L2, Tier.L3])
def test_a_request_walks_the_tree_at_most_twice(source: Tier | None) -> None:
    """admit and insert walk the tree; plan, restore, poll, prefix_pages, allocate and
    release work from what the request holds."""
    c = make()
    toks = list(range(12))
    r, _ = prefill(c, toks)
    c.release(r)
    settle(c)
    if source is not None:
        c.core.evict(Tier.L1, 10**6)
        if source is Tier.L3:
            c.core.evict(Tier.L2, 10**6)
    walks = c.core.tree.walks
    req = c.admit([*toks, 50, 51, 52])
    pending = c.start_restore(req, c.plan(req), layer_events=())
    while pending is not None and not pending.finished:
        c.poll()
    c.prefix_pages(req)
    pages = c.allocate(req, 2)
    assert pages is not None
    c.insert(req, pages[:1])
    c.prefix_pages(req)
    c.release(req)
    assert c.core.tree.walks - walks == 2
    c.close()


def _source(p: PendingRestore) -> Lease | None:
    return p.source  # read through a call: mypy keeps no narrowing across it


def test_a_restore_commits_exactly_its_decision() -> None:
    """start_restore pins the source run before making room, so the request holds it in the
    source tier for the whole restore (the request invariant), and S2H then H2D follow."""
    c = make()
    toks = list(range(8))
    r, kv = prefill(c, toks)
    c.release(r)
    settle(c)
    c.core.evict(Tier.L1, 10**6)
    c.core.evict(Tier.L2, 10**6)
    c.faults.add("slow", op="read", delay_s=0.02)
    req = c.admit(toks)
    pending = c.start_restore(req, c.plan(req))
    assert pending is not None and req.state is ReqState.LOADING_L3
    assert pending.source is not None and pending.source.tier is Tier.L3
    assert pending.transfer is not None and pending.transfer.direction is Direction.S2H
    c.check_integrity()
    while not pending.finished:
        c.poll()
        c.check_integrity()
    assert pending.done and _source(pending) is None
    assert c.status().request_states["ready"] == 1
    assert torch.equal(content(c, c.prefix_pages(req)), kv)
    c.release(req)
    c.close()


def test_a_restore_whose_prefix_reached_l1_meanwhile_names_the_whole_prefix() -> None:
    """Between admission and the restore, another request brings the upper run into L1: the
    H2D moves only the rest, and the layered page list still covers the whole prefix (the
    upper run's L1 pages, then the H2D's)."""
    c = make()
    p, pe = [1, 1, 2, 2], [1, 1, 2, 2, 3, 3]
    for toks in (p, pe):
        r, _ = prefill(c, toks)
        c.release(r)
        settle(c)
    c.core.evict(Tier.L1, 10**6)
    a = c.admit(pe)
    assert a.hit == (0, 6, 6)
    b, kv_p = prefill(c, p)  # recomputes P into L1 while A waits
    pending = c.start_restore(a, c.plan(a), layer_events=())
    assert pending is not None and pending.pages is not None and len(pending.pages) == 3
    assert pending.transfer is not None and len(pending.transfer.dst) == 1
    assert pending.pages[:2] == c.prefix_pages(b)
    c.check_integrity()
    while not pending.finished:
        c.poll()
    assert pending.done and c.prefix_pages(a) == pending.pages
    assert torch.equal(content(c, pending.pages[:2]), kv_p)
    c.release(a)
    c.release(b)
    c.close()
