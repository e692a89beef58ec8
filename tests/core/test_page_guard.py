"""``HiCacheConfig(guard_pages=True)``: an engine's writes into L1 pages it does not own (a
free page, a page of a cached prefix) are reported by ``check_integrity`` as
PageContentError; a loop that keeps to its pages, faults and failed copies included, is
never reported."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.core.geometry import KVGeometry
from hicache.errors import PageContentError

PS = 4
G = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PS, dtype=torch.float32)
A, B, C = list(range(10)), list(range(100, 110)), list(range(200, 210))


def make(guard: bool = True, **kw: object) -> HiCache:
    args: dict[str, object] = dict(l1_pages=6, l2_pages=16, device="cpu", policy="always", tracing=True)
    args.update(kw)
    return HiCache(HiCacheConfig(G, guard_pages=guard, **args))  # type: ignore[arg-type]


Bug = Callable[[HiCache, Sequence[int], Sequence[int]], None]  # (cache, prefix pages, own pages) -> None


def serve(cache: HiCache, prompt: list[int], before_insert: Bug | None = None, after_insert: Bug | None = None) -> None:
    """One request, as an engine serves it: its own pages get its K/V, then go to the tree."""
    req = cache.admit(prompt)
    cache.restore(req)
    have = cache.prefix_pages(req)
    own = cache.allocate(req, -(-len(prompt) // PS) - len(have))
    assert own is not None
    cache.l1.buffer[:, :, own] = float(prompt[0] + 1)
    if before_insert is not None:
        before_insert(cache, have, own)
    cache.insert(req, own[: len(prompt) // PS - len(have)])
    if after_insert is not None:
        after_insert(cache, have, own)
    cache.release(req)
    cache.drain()


def write(pages: Callable[[Sequence[int], Sequence[int]], Sequence[int]]) -> Bug:
    def bug(cache: HiCache, have: Sequence[int], own: Sequence[int]) -> None:
        cache.l1.buffer[:, :, pages(have, own)] = -7.0

    return bug


# (the bug, when it strikes, what the report says)
BUGS: dict[str, tuple[str, Bug, str]] = {
    "prefill-writes-the-cached-prefix": ("before", write(lambda have, own: have[:1]), "changed since it was published"),
    "kv-written-after-insert": ("after", write(lambda have, own: own[:1]), "changed since it was published"),
    "decode-after-release": ("released", write(lambda have, own: own[-1:]), "was written while free"),
}


@pytest.mark.parametrize("name", sorted(BUGS))
def test_a_write_outside_the_engines_pages_is_reported(name: str) -> None:
    when, bug, says = BUGS[name]
    cache = make()
    serve(cache, A)
    cache.check_integrity()
    if when == "released":
        req = cache.admit(B)
        own = cache.allocate(req, 3)
        assert own is not None
        cache.release(req)
        bug(cache, [], own)
    else:
        serve(cache, [*A, 1, 2, 3], **{f"{when}_insert": bug})
    with pytest.raises(PageContentError, match=says):
        cache.check_integrity()
    cache.close()


def test_without_the_guard_the_same_write_goes_unseen() -> None:
    """The guard is what sees it: the structure is intact either way."""
    cache = make(guard=False)
    serve(cache, A)
    serve(cache, [*A, 1, 2, 3], before_insert=write(lambda have, own: have[:1]))
    cache.check_integrity()
    cache.close()


def test_an_aborted_restores_page_written_after_the_release_is_reported() -> None:
    """A tail page allocated while the prefix loads, the request aborted, the page written."""
    cache = make()
    serve(cache, A)
    serve(cache, B)
    serve(cache, C)  # A leaves L1
    req = cache.admit(A)
    pending = cache.start_restore(req)
    assert pending is not None
    tail = cache.allocate(req, 1)
    assert tail is not None
    cache.release(req)
    cache.l1.buffer[:, :, tail] = 5.0
    with pytest.raises(PageContentError, match=f"L1 page {tail[0]} was written while free"):
        cache.check_integrity()
    cache.close()


def test_a_page_never_written_reads_as_nan() -> None:
    """A page handed out and read before the engine writes it shows (NaN K/V)."""
    cache = make()
    req = cache.admit(A)
    own = cache.allocate(req, 3)
    assert own is not None
    assert torch.isnan(cache.l1.buffer[:, :, own]).all()
    cache.release(req)
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("fault", [None, "fail"])
def test_a_loop_that_keeps_to_its_pages_is_never_reported(fault: str | None) -> None:
    """Evictions, restores from L2, copies that ran and then failed (their destination freed
    with bytes in it): hicache's own writes are never the engine's."""
    cache = make()
    for i, prompt in enumerate([A, B, C, A, B, [*A, 1], C, A, B, C] * 2):
        if fault is not None and i % 3 == 0:
            cache.faults.add(fault)  # type: ignore[arg-type]
        serve(cache, prompt)
        cache.check_integrity()
    assert cache.status().metrics["restores"] > 0
    cache.close()


def test_a_page_allocate_takes_by_evicting_reads_as_nan_too() -> None:
    """Under pressure allocate evicts a cached prefix and hands its pages out at once: they
    are filled as a free page is, not left holding the evicted K/V."""
    cache = make(l1_pages=3, l2_pages=0)
    serve(cache, A[:8])  # 2 pages, cached in L1
    req = cache.admit(B[:8])
    own = cache.allocate(req, 3)  # more than the one free page: the prefix is evicted
    assert own is not None
    assert torch.isnan(cache.l1.buffer[:, :, own]).all()
    cache.release(req)
    cache.check_integrity()
    cache.close()
