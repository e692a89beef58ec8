"""Numpy integers, as a tokenizer or an engine's arithmetic hands them, are the ints they
hold wherever the controller takes a count (tokens, at_most, allocate, observe_prefill);
numpy floats and bools are still refused."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.core.cache import CacheCore
from hicache.core.geometry import KVGeometry, TierSizes
from hicache.errors import MisuseError, PageOwnershipError
from hicache.spec.model import Tier

G = KVGeometry(2, 1, 4, 2, torch.float32)


def test_numpy_integers_are_taken_as_ints() -> None:
    with HiCache(HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu")) as c:
        req = c.admit([np.int64(1), np.int32(2), np.int64(3), np.int64(4), np.uint16(5)], at_most=np.int64(4))  # type: ignore[arg-type]
        assert req.tokens == (1, 2, 3, 4, 5) and all(type(t) is int for t in req.tokens)
        pages = c.allocate(req, np.int64(3))  # type: ignore[arg-type]
        assert pages is not None and len(pages) == 3
        assert c.insert(req, pages[:2]) == 4  # the whole page goes to the tree
        c.observe_prefill(np.int64(5), 0.01)  # type: ignore[arg-type]
        assert list(c.controller.cost.recompute.samples) == [(5, 0.01)]
        c.release(req)
        again = c.admit([1, 2, 3, 4, 5], at_most=np.int8(4))  # type: ignore[arg-type]
        assert again.cached_len == 4  # at_most kept the match to the first page
        c.release(again)


@pytest.mark.parametrize("bad", [np.float64(2.0), np.bool_(True)])
def test_numpy_floats_and_bools_are_still_refused(bad: object) -> None:
    with HiCache(HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu")) as c:
        req = c.admit([1, 2, 3])
        with pytest.raises(MisuseError, match=r"^allocate: page count must be an int >= 0"):
            c.allocate(req, bad)  # type: ignore[arg-type]
        with pytest.raises(MisuseError, match=r"^observe_prefill: tokens must be an int"):
            c.observe_prefill(bad, 0.1)  # type: ignore[arg-type]
        with pytest.raises(MisuseError, match=r"^admit: at_most must be None or an int"):
            c.admit([1, 2], at_most=bad)  # type: ignore[arg-type]
        assert c.allocate(req, 1) is not None  # the request goes on
        c.release(req)


@pytest.mark.parametrize(
    "as_given",
    [
        lambda pages: [np.int64(p) for p in pages],
        lambda pages: np.asarray(pages),
        lambda pages: torch.tensor(pages),
        lambda pages: torch.tensor(pages, dtype=torch.int32),
    ],
    ids=["numpy ints", "numpy array", "tensor", "int32 tensor"],
)
def test_insert_takes_page_ids_as_an_engine_keeps_them(as_given: object) -> None:
    """The ids allocate() handed out, back as numpy integers or a 1-D array or tensor (an
    engine's page table row), are the same pages: inserted, and in the tree."""
    with HiCache(HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu")) as c:
        req = c.admit(list(range(9)))
        pages = c.allocate(req, 5)
        assert pages is not None
        assert c.insert(req, as_given(pages[:4])) == 8  # type: ignore[operator]
        assert c.prefix_pages(req) == pages[:4] and req.private == [pages[4]]
        c.release(req)
        again = c.admit(list(range(9)))
        assert again.cached_len == 8
        c.release(again)
        c.check_integrity()


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (lambda pages: [float(p) for p in pages], "page ids must be ints, got 0.0 (float)"),
        (lambda pages: [np.bool_(True)], "page ids must be ints, got"),
        (lambda pages: [True], "page ids must be ints, got True (bool)"),
        (lambda pages: torch.tensor(pages, dtype=torch.float32), "page ids must be ints, got 0.0 (float)"),
        (lambda pages: torch.tensor([pages]), "pages must be a sequence of page ids, got Tensor"),
        (lambda pages: torch.tensor(pages, device="meta"), "pages must be ids this process can read, got a Tensor"),
        (lambda pages: torch.tensor(pages).to_sparse(), "pages must be ids this process can read, got a Tensor"),
        (lambda pages: [pages[0], pages[0]], "pages must be distinct private pages"),
    ],
    ids=["floats", "numpy bool", "bool", "float tensor", "2-D tensor", "meta tensor", "sparse tensor", "duplicates"],
)
def test_insert_refuses_page_ids_that_are_not_ints_and_changes_nothing(bad: object, says: str) -> None:
    with HiCache(HiCacheConfig(G, l1_pages=8, l2_pages=8, device="cpu")) as c:
        req = c.admit(list(range(9)))
        pages = c.allocate(req, 5)
        assert pages == [0, 1, 2, 3, 4]
        before = c.status()
        with pytest.raises(MisuseError, match=f"^insert: {re.escape(says)}") as refused:
            c.insert(req, bad(pages[:4]))  # type: ignore[operator]
        # NOTE: a page that is not an id of the caller's (not an int, given twice) is the
        # typed PageOwnershipError; a container that is not ids at all the plain MisuseError
        owned = says.startswith(("page ids", "pages must be distinct"))
        assert type(refused.value) is (PageOwnershipError if owned else MisuseError)
        assert c.status() == before and req.private == pages and req.cached_len == 0
        assert c.insert(req, pages[:4]) == 8  # the request goes on as if nothing was tried
        c.release(req)
        c.check_integrity()


@pytest.mark.parametrize(
    "bad",
    [float, np.float64, lambda p: bool(p) if p in (0, 1) else p, lambda p: np.array([p], dtype=np.float32)[0]],
    ids=["float", "numpy float", "bool", "numpy float32"],
)
def test_core_insert_refuses_ids_equal_to_a_private_page_that_are_not_ints(bad: Callable[[int], object]) -> None:
    """``CacheCore.insert`` checks ids by type: 0.0 or False equal (and hash as) page 0, and
    the tree would publish them as page ids, which the allocator refuses at eviction."""
    core = CacheCore(2, TierSizes(8, 8, 8))
    pages = core.allocate_l1(2)
    assert pages == [0, 1]
    with pytest.raises(PageOwnershipError, match=r"^insert: page ids must be ints, got"):
        core.insert((1, 2, 3, 4), [bad(p) for p in pages])  # type: ignore[misc]
    assert core.private == {0, 1} and not core.tree.root.children
    result = core.insert((1, 2, 3, 4), [np.int64(p) for p in pages])  # type: ignore[misc]  # numpy ints are ids
    assert result.node is not None and [type(p) for p in result.node.pages[Tier.L1] or []] == [int, int]
    assert core.evict(Tier.L1, 8) == 2 and core.l1.num_free == 8
    core.check_integrity()
